"""vocab_parallel_cross_entropy against F.cross_entropy on the full logits: losses and logit gradients for every
reduction, label smoothing, ignore_index (the default and a real class id), uneven vocabularies, bf16 logits,
the three ways to give the vocabulary split, and every error case."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tpkit
from tpkit.comm import create_communicators, split_sizes
from tpkit.nn import vocab_parallel_cross_entropy

from .helpers import FP64_TOL, THREAD_SIZES, assert_small, local_slice, randn, rel_err, run


def _case(vocab: int, dtype, seed: int, ignore_index: int):
    logits = 3 * randn((2, 5, vocab), seed, torch.float64).to(dtype)
    target = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(seed))
    target[0, 1] = ignore_index
    target[1, -1] = vocab - 1  # the last rank's last class
    target[1, 0] = 0
    return logits, target


def ce_checks(dtype_name: str = "float64") -> dict:
    dtype = getattr(torch, dtype_name)
    comm = tpkit.get_communicator()
    errors = {}
    for vocab in (11, 16):
        sizes = split_sizes(vocab, comm.world_size)
        for ignore_index in (-100, 3):
            for smoothing in (0.0, 0.2):
                for reduction in ("none", "mean", "sum"):
                    logits, target = _case(vocab, dtype, vocab + ignore_index, ignore_index)
                    full = logits.clone().requires_grad_()
                    want = F.cross_entropy(full.transpose(1, 2), target, ignore_index=ignore_index,
                                           label_smoothing=smoothing, reduction=reduction)
                    gy = randn(want.shape, 5, torch.float64).to(want.dtype) if reduction == "none" else None
                    want.backward(gy)
                    local = local_slice(logits, -1, sizes, comm.rank).clone().requires_grad_()
                    split = {"vocab_size": vocab} if ignore_index < 0 else {"partition_sizes": sizes}
                    if smoothing == 0.0 and reduction == "sum":
                        split = {}  # the ranks exchange their slice sizes
                    got = vocab_parallel_cross_entropy(local, target, ignore_index=ignore_index,
                                                       label_smoothing=smoothing, reduction=reduction, **split)
                    got.backward(gy)
                    tag = f"V={vocab} ignore={ignore_index} ls={smoothing} {reduction}"
                    errors[f"{tag} loss"] = rel_err(got, want)
                    errors[f"{tag} dlogits"] = rel_err(local.grad, local_slice(full.grad, -1, sizes, comm.rank))
    return errors


def ce_bf16_checks() -> dict:
    """bf16 logits: fp32 loss and math, bf16 gradient; compared with F.cross_entropy on the fp32 upcast."""
    comm = tpkit.get_communicator()
    logits, target = _case(50, torch.bfloat16, 1, -100)
    sizes = split_sizes(50, comm.world_size)
    full = logits.float().requires_grad_()
    want = F.cross_entropy(full.transpose(1, 2), target, label_smoothing=0.1)
    want.backward()
    local = local_slice(logits, -1, sizes, comm.rank).clone().requires_grad_()
    got = vocab_parallel_cross_entropy(local, target, label_smoothing=0.1, vocab_size=50)
    got.backward()
    assert got.dtype == torch.float32 and local.grad.dtype == torch.bfloat16
    return {"bf16 loss": rel_err(got, want),
            "bf16 dlogits": rel_err(local.grad.float(), local_slice(full.grad, -1, sizes, comm.rank))}


@pytest.mark.parametrize("world_size", THREAD_SIZES)
def test_cross_entropy_matches_full_threads(world_size):
    assert_small(run(ce_checks, world_size, "threads"), FP64_TOL)
    for errors in run(ce_bf16_checks, world_size, "threads"):
        assert errors["bf16 loss"] < 1e-5  # fp32 math
        assert errors["bf16 dlogits"] < 2 ** -8  # one bf16 rounding of the fp32 gradient


def test_all_ignored_mean_is_nan_like_torch():
    logits, target = torch.randn(3, 7), torch.full((3,), -100)
    assert torch.isnan(F.cross_entropy(logits, target)) and torch.isnan(vocab_parallel_cross_entropy(logits, target))


def _rank_errors() -> str:
    local = torch.randn(4, 5)
    with pytest.raises(ValueError, match=r"this rank \(rank \d\) holds 5 logits per token, but the vocabulary split "
                                         r"\[6, 6\] gives it 6"):
        vocab_parallel_cross_entropy(local, torch.zeros(4, dtype=torch.long), vocab_size=12)
    with pytest.raises(ValueError, match=r"partition_sizes \[10\] must have one entry per rank \(2\)"):
        vocab_parallel_cross_entropy(local, torch.zeros(4, dtype=torch.long), partition_sizes=[10])
    with pytest.raises(RuntimeError, match=r"target ids must be in 0\.\.9 "):  # device-side assertion
        vocab_parallel_cross_entropy(local, torch.tensor([0, 1, 10, -100]), vocab_size=10)
    return "ok"


def test_errors():
    assert run(_rank_errors, 2, "threads") == ["ok", "ok"]
    comm = create_communicators(1)[0]
    logits, target = torch.randn(4, 5), torch.zeros(4, dtype=torch.long)
    cases = [
        (dict(logits=logits, target=torch.zeros(3, dtype=torch.long)), ValueError,
         r"target of shape \(3,\) must match logits of shape \(4, 5\) without its last \(class\) dim, i\.e\. \(4,\)"),
        (dict(logits=logits, target=torch.zeros(4)), TypeError, "target must be an integer tensor"),
        (dict(logits=target, target=target), TypeError, "logits must be a floating tensor"),
        (dict(logits=logits, target=target, reduction="avg"), ValueError, "reduction 'avg' must be"),
        (dict(logits=logits, target=target, label_smoothing=1.5), ValueError, r"label_smoothing 1\.5 must be in"),
    ]
    for kwargs, exc, message in cases:
        with pytest.raises(exc, match=f"vocab_parallel_cross_entropy: {message}"):
            vocab_parallel_cross_entropy(comm=comm, **kwargs)


def test_backward_twice_with_retain_graph_like_torch():
    """The saved softmax is not consumed by backward: a second backward gives the same gradient."""
    def body():
        comm = tpkit.get_communicator()
        full = randn((3, 4, 10), 5, torch.float64)
        target = torch.randint(0, 10, (3, 4), generator=torch.Generator().manual_seed(6))
        local = local_slice(full, -1, split_sizes(10, comm.world_size), comm.rank).clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, target, label_smoothing=0.1, vocab_size=10)
        first, = torch.autograd.grad(loss, local, retain_graph=True)
        second, = torch.autograd.grad(loss, local)
        return rel_err(second, first)

    for world_size in (1, 2, 3):
        assert max(run(body, world_size, "threads")) == 0.0
