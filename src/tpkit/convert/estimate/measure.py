"""Any other module is measured (`measure_step`): one forward of a copy, the bytes autograd saves for backward
deduplicated by storage, attributed to a rank by the converter's plan (between a column and a row layer the
activations are split) and scaled linearly with the batch.

The split is followed leaf by leaf with forward hooks: after a column layer the activations are split over the
ranks until the row layer (or gather) that makes them whole again, which is where the plan's collectives sit.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tpkit.comm.sharding import split_sizes


_OUT_SPLIT = {"colwise", "vocab_parallel"}                  # output stays split
_GATHERED = {"colwise_rep", "embedding_colwise"}            # output all-gathered: full again
_REDUCED = {"rowwise", "rowwise_rep", "embedding_rowwise"}  # output all-reduced: full again


def _leaves(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules()
            if next(iter(m.parameters(recurse=False)), None) is not None or not next(iter(m.children()), None)}


def _fallback_style(m: nn.Module, sharded: bool, t: int) -> str:
    """Type rule when no plan exists: a Linear/Conv2d whose output divides starts a pair (column), the next
    one whose input divides ends it (row); embeddings split the vocabulary; BatchNorm inside a pair is split."""
    from torch.nn.modules.batchnorm import _BatchNorm

    if isinstance(m, nn.Embedding) and m.num_embeddings % t == 0:
        return "embedding_rowwise"
    if isinstance(m, _BatchNorm) and sharded:
        return "channelwise"
    if isinstance(m, nn.Linear) or (isinstance(m, nn.Conv2d) and m.groups == 1):
        n_in = m.in_features if isinstance(m, nn.Linear) else m.in_channels
        n_out = m.out_features if isinstance(m, nn.Linear) else m.out_channels
        if sharded and n_in % t == 0:
            return "rowwise"
        if not sharded and n_out % t == 0:
            return "colwise"
    return "replicate"


def _param_bytes_per_rank(m: nn.Module, style: str, t: int) -> float:
    """Bytes of `m`'s own parameters on rank 0 under `style` (dims as tpkit shards them)."""
    transposed = type(m).__name__ == "Conv1D"  # Hugging Face's linear with a (in, out) weight
    total = 0.0
    for pname, p in m.named_parameters(recurse=False):
        dim = None
        if style in _OUT_SPLIT | {"colwise_rep", "embedding_rowwise", "channelwise"}:
            dim = (1 if transposed and pname == "weight" else 0) if p.dim() else None
            if style == "embedding_rowwise" and pname != "weight":
                dim = None
        elif style in {"rowwise", "rowwise_rep"}:
            dim = (0 if transposed else 1) if pname == "weight" else None
        elif style == "embedding_colwise":
            dim = 1 if pname == "weight" else None
        if dim is None or p.dim() <= dim:
            total += p.numel() * p.element_size()
        else:
            total += p.numel() // p.shape[dim] * split_sizes(p.shape[dim], t)[0] * p.element_size()
    return total


def measure_step(model: nn.Module, args=(), kwargs=None, styles=None, world_size: int = 1,
                 training: bool = True) -> dict[str, Any]:
    """Run `model(*args, **kwargs)` once and measure, at world size 1 and on rank 0 of `world_size`:
    activations (training: bytes saved for backward, deduplicated by storage, parameters excluded;
    inference: the largest input+output of one layer), parameter bytes, forward FLOPs (those inside a
    column -> row pair divide over the ranks) and the collectives the plan adds, in order, as
    `(kind, result bytes)` with kind "all_reduce" or "all_gather".

    `styles` maps module names to plan styles; None applies the type rule of `_fallback_style`.
    """
    from torch.utils.flop_counter import FlopCounterMode

    kwargs = kwargs or {}
    t = world_size
    leaves = _leaves(model)
    state = {"sharded": False, "region": False, "in": 0.0, "in1": 0.0, "live": [0.0, 0.0], "mark": 0,
             "flops": [0, 0]}  # flops outside / inside a split region
    chosen: dict[str, str] = {}
    collectives: list[int] = []
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    param_ptrs |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    saved: dict[int, tuple[int, bool]] = {}
    counter = FlopCounterMode(display=False)

    def nbytes(x) -> int:
        return sum(v.numel() * v.element_size() for v in (x if isinstance(x, (tuple, list)) else [x])
                   if isinstance(v, torch.Tensor))

    def account_flops():
        total = counter.get_total_flops()
        state["flops"][1 if state["region"] else 0] += total - state["mark"]
        state["mark"] = total

    def pre(name):
        def hook(module, inputs):
            if name not in chosen:
                chosen[name] = (styles.get(name, "replicate") if styles is not None
                                else _fallback_style(module, state["sharded"], t)) if t > 1 else "replicate"
            account_flops()
            if chosen[name] in _OUT_SPLIT | {"colwise_rep"}:
                state["region"] = True
            state["in"] = nbytes(inputs) / (t if state["sharded"] else 1)
            state["in1"] = nbytes(inputs)
        return hook

    def post(name):
        def hook(module, inputs, output):
            account_flops()
            style = chosen.get(name, "replicate")
            if style in _OUT_SPLIT:
                state["sharded"] = True
            elif style in _GATHERED | _REDUCED:
                state["sharded"] = state["region"] = False
                collectives.append(("all_gather" if style in _GATHERED else "all_reduce", nbytes(output)))
            out = nbytes(output)
            state["live"][0] = max(state["live"][0], state["in1"] + out)
            state["live"][1] = max(state["live"][1], state["in"] + out / (t if state["sharded"] else 1))
        return hook

    def pack(x):
        st = x.untyped_storage()
        if st.data_ptr() not in param_ptrs and st.data_ptr() not in saved:
            saved[st.data_ptr()] = (st.nbytes(), state["sharded"])
        return x

    handles = [m.register_forward_pre_hook(pre(n)) for n, m in leaves.items()]
    handles += [m.register_forward_hook(post(n)) for n, m in leaves.items()]
    try:
        with counter:
            if training:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                    model(*args, **kwargs)
            else:
                with torch.no_grad():
                    model(*args, **kwargs)
            account_flops()
    finally:
        for h in handles:
            h.remove()
    if training:
        one = float(sum(n for n, _ in saved.values()))
        many = float(sum(math.ceil(n / t) if sharded else n for n, sharded in saved.values()))
    else:
        one, many = state["live"]
    seen, params_one, params_rank = set(), 0.0, 0.0
    for name, m in leaves.items():
        own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen |= {id(p) for p in own}
        if own:
            params_one += sum(p.numel() * p.element_size() for p in own)
            params_rank += _param_bytes_per_rank(m, chosen.get(name, "replicate"), t)
    collectives = collectives if t > 1 else []
    outside, inside = state["flops"]
    largest = float(max((n for _, n in collectives), default=0))
    return {"activations": one, "activations_per_rank": many, "communication": largest,
            "collectives": collectives, "parameter_bytes": params_one, "parameter_bytes_per_rank": params_rank,
            "flops": float(outside + inside), "flops_per_rank": outside + inside / t}
