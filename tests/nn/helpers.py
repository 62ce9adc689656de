"""Shared pieces of the tpkit.nn tests: seeded reference modules that never touch the global RNG (thread-ranks
share it), relative errors, and running one check function on every rank of a backend."""
from __future__ import annotations

import torch
from torch import nn

import tpkit

FP64_TOL = 1e-10
FP32_TOL = 1e-5
THREAD_SIZES = [1, 2, 3, 4]


def randn(shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def seeded_linear(in_features: int, out_features: int, bias: bool, seed: int, dtype=torch.float64) -> nn.Linear:
    m = torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias, dtype=dtype)
    with torch.no_grad():
        m.weight.copy_(randn(m.weight.shape, seed, dtype))
        if bias:
            m.bias.copy_(randn(m.bias.shape, seed + 1, dtype))
    return m


def seeded_embedding(num: int, dim: int, seed: int, padding_idx=None, dtype=torch.float64) -> nn.Embedding:
    m = torch.nn.utils.skip_init(nn.Embedding, num, dim, padding_idx=padding_idx, dtype=dtype)
    with torch.no_grad():
        m.weight.copy_(randn(m.weight.shape, seed, dtype))
        if padding_idx is not None:
            m.weight[padding_idx].zero_()
    return m


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (inf on a shape mismatch, so a wrong shape always fails)."""
    if got is None or want is None or got.shape != want.shape:
        return float("inf")
    scale = want.detach().abs().max().clamp_min(1e-30)
    return float((got.detach().double() - want.detach().double()).abs().max() / scale)


def local_slice(t: torch.Tensor, dim: int, sizes, rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return t.narrow(dim, start, sizes[rank])


def run(fn, world_size: int, backend: str, *args) -> list:
    return tpkit.launch(fn, world_size, backend=backend, args=args)


def assert_small(results: list[dict], tol: float) -> None:
    """Every rank's every named error is below `tol` (and there was something to check)."""
    assert results and all(results), "no checks ran"
    for rank, errors in enumerate(results):
        for name, err in errors.items():
            assert err < tol, f"rank {rank}: {name}: relative error {err:.3g} >= {tol:g}"


def copied(model: nn.Module, how: str) -> nn.Module:
    """`model` after one of the paths users take that copy a module whole: `copy.deepcopy`, or `torch.save` then
    `torch.load` of the module (a pickle of it, through a buffer)."""
    import copy
    import io

    if how == "deepcopy":
        return copy.deepcopy(model)
    if how in ("torch.save", "pickle"):
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)
    raise ValueError(how)


def assert_greedy_up_to_ties(tokens: torch.Tensor, exact: nn.Module, prompt: int, tie: float = 0.01) -> None:
    """Each token of `tokens` after the first `prompt` is the greedy choice of `exact` (the model in float64) on the
    tokens before it, or within `tie` of the logits' range from it: a bf16 decode may take either side of a near tie
    (docs/how-to/generate.md), never a token the exact model ranks well below."""
    with torch.no_grad():
        logits = exact.eval()(tokens).logits[0, prompt - 1:-1]
    chosen = logits.gather(-1, tokens[0, prompt:, None])[:, 0]
    best, spread = logits.max(-1).values, logits.max(-1).values - logits.min(-1).values
    deficit = ((best - chosen) / spread).tolist()
    assert all(d <= tie for d in deficit), f"tokens {tokens[0, prompt:].tolist()}: below the exact best by {deficit}"
