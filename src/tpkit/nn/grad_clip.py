"""Gradient clipping by the global norm of a tensor-parallel model.

The single-device norm is over every element once. Shards hold disjoint pieces, so their per-rank sums of |g|^p add
up across ranks (one all-reduce); replicated parameters hold the same gradient on every rank, so they are counted
once, locally, after the reduction. Entries of a shard that several ranks hold (KV heads replicated) add
|g|^p / holders on each. Every rank ends with the same norm and the same clip coefficient, so shards and replicas
stay consistent.

Which parameter is split, along which dim, and which entries several ranks hold is read from the model's record by
the parameter's name (`record.py`), never from the tensor: the answer holds whatever Parameter object sits under
the name now (after `load_state_dict(assign=True)`, in a deep copy). A model under `tpkit.data_parallel` computes
its norm over both dimensions through its record's data-parallel facts; the clipping itself stays here.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from ..comm.communicator import Communicator
from ..comm.ops import ReduceOp
from ._layer import resolve_comm
from .record import Holder, ModelRecord, holders, live_records, settle

#: One gradient's part of the norm: (gradient, holders of each entry along `dim` or None when each entry is held
#: once, dim).
NormItem = tuple[torch.Tensor, "Sequence[int] | None", int]


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    comm: Communicator | None = None, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale gradients in place so the global `norm_type` norm is at most `max_norm`; return the norm (fp32, or
    fp64 for fp64 gradients).

    Like `torch.nn.utils.clip_grad_norm_`, but the norm is that of the full, unsharded model. Collective. `comm`:
    the tensor-parallel group, for parameters of no converted model (default: the model's own, else
    `tpkit.get_communicator()`)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    if not (norm_type == math.inf or norm_type > 0):
        raise ValueError(f"clip_grad_norm_: norm_type {norm_type} must be positive or inf")
    if float(max_norm) < 0:
        raise ValueError(f"clip_grad_norm_: max_norm {max_norm} must be non-negative")
    total, grads = global_norm(params, norm_type, comm)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is {float(total)}; set "
                           f"error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def global_norm(params: list[torch.Tensor], norm_type: float,
                comm: Communicator | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`(the norm over every dimension the parameters are split or replicated along, the gradients to scale)`."""
    held = holders(params)
    if len(held) < len(params):  # FSDP2 may hold unsharded Parameters after a forward under no_grad
        pending = [r for r in live_records() if r.data_parallel is not None]
        if pending:
            settle(pending)
            held = holders(params)
    record = _one_record(held.values(), comm)
    if record is not None and record.pipeline is not None:  # one stage of several: its facts add the pp dimension
        return record.pipeline.global_norm(params, held, norm_type)
    total, grads = partial_norm(params, held, norm_type, record, comm)
    return (total if norm_type == math.inf else total.pow(1.0 / norm_type)), grads


def partial_norm(params: list[torch.Tensor], held: dict[int, Holder], norm_type: float, record: ModelRecord | None,
                 comm: Communicator | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`(the sum of |g|^p over the model's tp and dp dimensions, or their maximum for the inf norm; the gradients)`:
    the norm before its root, so a pipeline can add its stages' sums."""
    experts = record.experts if record is not None else None
    if experts is None:
        return _model_norm(params, held, norm_type, record, comm)
    # each expert once over its expert group (`tpkit.expert_parallel`), added to the rest of the model's
    mine = {id(p) for p in params if (h := held.get(id(p))) is not None and h.key in experts.keys}
    rest, grads = _model_norm([p for p in params if id(p) not in mine], held, norm_type, record, comm)
    held_grads = [p.grad for p in params if id(p) in mine and p.grad is not None]
    items = [(g.to_local() if hasattr(g, "to_local") else g, None, 0) for g in held_grads]  # FSDP2's shards
    dtype = torch.float64 if any(g.dtype == torch.float64 for g, _, _ in items) else rest.dtype
    op = ReduceOp.MAX if norm_type == math.inf else ReduceOp.SUM
    part = experts.ep.all_reduce(power_sum(items, norm_type, dtype, torch.device("cpu")), op)
    if experts.fsdp:  # each rank of the expert-data group holds a shard of its experts
        part = experts.edp.all_reduce(part, op)
    part = part.to(rest.device, rest.dtype)
    return (torch.maximum(rest, part) if op is ReduceOp.MAX else rest + part), grads + held_grads


def _model_norm(params: list[torch.Tensor], held: dict[int, Holder], norm_type: float, record: ModelRecord | None,
                comm: Communicator | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`partial_norm` of parameters split or replicated over the tp and dp dimensions only (no expert weights)."""
    if record is not None and record.data_parallel is not None:
        return record.data_parallel.global_norm(params, held, norm_type, root=False)
    group = record.comm if record is not None and record.comm is not None else resolve_comm(comm)
    split, whole = norm_items(params, held)
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    # fp32 at least (bf16 squares overflow and round badly), fp64 when the model is fp64.
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    shards, mine = power_sum(split, norm_type, dtype, device), power_sum(whole, norm_type, dtype, device)
    if norm_type == math.inf:
        return torch.maximum(group.all_reduce(shards, ReduceOp.MAX), mine), grads
    return group.all_reduce(shards) + mine, grads


def _one_record(found: Iterable[Holder], comm: Communicator | None) -> ModelRecord | None:
    """The record the parameters belong to; parameters of models converted on different groups, or a `comm` that
    is not the model's group, raise (their norms would mix groups)."""
    records = {id(h.record): h.record for h in found if h.record is not None}
    comms = {(r.comm.name, r.comm.world_size) if r.comm is not None else None for r in records.values()}
    if len(comms) > 1:
        raise ValueError(f"clip_grad_norm_: the parameters belong to {len(records)} models converted on different "
                         f"tensor-parallel groups ({sorted(map(str, comms))}); clip each model's parameters apart")
    record = next(iter(records.values()), None)
    if record is not None and comm is not None and record.comm is not None and (
            comm.name, comm.world_size, comm.rank) != (record.comm.name, record.comm.world_size, record.comm.rank):
        raise ValueError(f"clip_grad_norm_: comm is {comm!r}, but the parameters belong to a model converted on "
                         f"{record.comm!r}; leave comm out (the model's own group is used)")
    return record


def norm_items(params: Sequence[torch.Tensor], held: dict[int, Holder]) -> tuple[list[NormItem], list[NormItem]]:
    """`(split items, replicated items)` of the parameters with a gradient, from their holders."""
    split, whole = [], []
    for p in params:
        if p.grad is None:
            continue
        h = held.get(id(p))
        lay = h.layout(p) if h is not None else None
        if lay is not None and not (lay.dim is None or lay.is_replicated):
            reps = lay.replicas()
            split.append((p.grad, reps if max(reps, default=1) > 1 else None, 1 - lay.dim if lay.transposed
                          else lay.dim))
        elif lay is None and h is not None and h.dim is not None:
            split.append((p.grad, None, h.dim))
        else:
            whole.append((p.grad, None, 0))
    return split, whole


def power_sum(items: Iterable[NormItem], norm_type: float, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """This rank's part of the norm: the sum of |g|^p over `items` (gradient, replicas, dim), or their maximum
    for the inf norm. With `replicas` (one count per index along `dim`) each slice counts 1/replicas, since that
    many ranks add it (a maximum is not changed by counting a slice twice). Shared with the 2-D norm of
    `tpkit.data_parallel`."""
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
