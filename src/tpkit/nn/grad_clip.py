"""Gradient clipping by the global norm of a tensor-parallel model.

The single-device norm is over every element once. Shards (`param.tensor_model_parallel`) hold disjoint
pieces, so their per-rank sums of |g|^p add up across ranks (one all-reduce); replicated parameters hold the
same gradient on every rank, so they are counted once, locally, after the reduction. Slices of a shard that
several ranks hold (`param.partition_replicas`, e.g. replicated KV heads) add |g|^p / replicas on each. Every rank ends with the
same norm and the same clip coefficient, so shards and replicas stay consistent. Replicated gradients must
already be equal across ranks (call `sync_sequence_parallel_grads` first under sequence parallelism).

Parameters whose layout `nn` cannot see (a model under torch's FSDP2, which replaces the Parameters and so drops
the marks above, or any layout over more than one dimension) are counted by a *norm source* registered in
`NORM_SOURCES` by the layer that made the layout (`tpkit.data_parallel`); the clipping itself stays here.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import torch

from ..comm.communicator import Communicator
from ..comm.ops import ReduceOp
from ._layer import resolve_comm
from .partition import is_tensor_parallel


# A norm source takes (parameters, norm_type) and returns None when it does not know these parameters, or
# (global norm, the plain tensors to scale in place) when it does. Collective: every rank must get the same answer.
NormSource = Callable[[list[torch.Tensor], float], "tuple[torch.Tensor, list[torch.Tensor]] | None"]
NORM_SOURCES: list[NormSource] = []


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    comm: Communicator | None = None, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale gradients in place so the global `norm_type` norm is at most `max_norm`; return the norm (fp32, or
    fp64 for fp64 gradients).

    Like `torch.nn.utils.clip_grad_norm_`, but the norm is that of the full, unsharded model. Collective.
    """
    comm = resolve_comm(comm)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    if not (norm_type == math.inf or norm_type > 0):
        raise ValueError(f"clip_grad_norm_: norm_type {norm_type} must be positive or inf")
    if float(max_norm) < 0:
        raise ValueError(f"clip_grad_norm_: max_norm {max_norm} must be non-negative")
    found = next((r for r in (source(params, norm_type) for source in list(NORM_SOURCES)) if r is not None), None)
    total, grads = found if found is not None else (_tensor_parallel_norm(params, norm_type, comm), [
        p.grad for p in params if p.grad is not None])
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is {float(total)}; set "
                           f"error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def _tensor_parallel_norm(params: list[torch.Tensor], norm_type: float, comm: Communicator) -> torch.Tensor:
    """The global norm over the TP group, from the marks tpkit layers set on their parameters."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [(p.grad, getattr(p, "partition_replicas", None), getattr(p, "partition_dim", 0))
               for p in params if p.grad is not None and is_tensor_parallel(p)]
    replicated = [(p.grad, None, 0) for p in params if p.grad is not None and not is_tensor_parallel(p)]
    device = grads[0].device if grads else torch.device("cpu")
    # fp32 at least (bf16 squares overflow and round badly), fp64 when the model is fp64.
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    shards, mine = power_sum(sharded, norm_type, dtype, device), power_sum(replicated, norm_type, dtype, device)
    if norm_type == math.inf:
        return torch.maximum(comm.all_reduce(shards, ReduceOp.MAX), mine)
    return (comm.all_reduce(shards) + mine).pow(1.0 / norm_type)


def power_sum(items: Iterable[tuple[torch.Tensor, Sequence[int] | None, int]], norm_type: float,
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's part of the norm: the sum of |g|^p over `items` (gradient, replicas, dim), or their maximum
    for the inf norm. With `replicas` (one count per index along `dim`) each slice counts 1/replicas, since that
    many ranks add it (a maximum is not changed by counting a slice twice). Shared with the 2-D norm of
    `tpkit.data_parallel`, which finds the replicas by parameter name."""
    total = torch.zeros((), dtype=dtype, device=device)
    for g, replicas, dim in items:
        if g.numel() == 0:
            continue
        g = g.detach()
        if norm_type == math.inf:
            total = torch.maximum(total, g.abs().max().to(device, dtype))
        elif replicas is None:
            total = total + torch.linalg.vector_norm(g, norm_type, dtype=dtype).pow(norm_type).to(device)
        else:
            sums = g.to(dtype).abs().pow(norm_type).movedim(dim, 0).reshape(g.shape[dim], -1).sum(dim=1)
            total = total + (sums / torch.tensor(replicas, dtype=dtype, device=sums.device)).sum().to(device)
    return total
