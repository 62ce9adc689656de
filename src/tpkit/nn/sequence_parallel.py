"""Gradients of replicated parameters under sequence parallelism.

With sequence parallelism a LayerNorm / RMSNorm (or a RowParallelLinear bias) sees only this rank's slice of
the sequence, so its gradient on each rank is a partial sum over that slice. Summing the partial gradients
over the tensor-parallel group gives the single-device gradient. Mark such parameters once
(`mark_sequence_parallel`, which sets `param.sequence_parallel = True`; RowParallelLinear marks its own bias),
then call `sync_sequence_parallel_grads(model)` after backward and before clipping / the optimizer step.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..comm.communicator import Communicator


def mark_sequence_parallel(params: nn.Module | Iterable[torch.Tensor]) -> None:
    """Mark replicated parameters (all of a module's, e.g. a norm's) whose gradients need the TP all-reduce."""
    items = params.parameters() if isinstance(params, nn.Module) else params
    for p in items:
        if getattr(p, "tensor_model_parallel", False):
            raise ValueError(f"mark_sequence_parallel: a parameter of shape {tuple(p.shape)} is a tensor-parallel "
                             f"shard; only replicated parameters need the sequence-parallel gradient sync")
        p.sequence_parallel = True  # type: ignore[attr-defined]


def sequence_parallel_params(params: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters marked `sequence_parallel`."""
    items = params.parameters() if isinstance(params, nn.Module) else params
    return [p for p in items if getattr(p, "sequence_parallel", False)]


def sync_sequence_parallel_grads(params: nn.Module | Iterable[torch.Tensor], comm: Communicator | None = None) -> int:
    """All-reduce (sum) the gradients of marked parameters over the TP group, in one collective per dtype.

    Returns how many gradients were synchronised. Collective: every rank calls it with the same parameters.
    """
    from ._layer import resolve_comm

    comm = resolve_comm(comm)
    grads = [p.grad for p in sequence_parallel_params(params) if p.grad is not None]
    if comm.world_size == 1 or not grads:
        return len(grads)
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        total = comm.all_reduce(flat)
        offset = 0
        for g in group:
            g.copy_(total[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(grads)
