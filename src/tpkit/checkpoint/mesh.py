"""Checkpoints of models under data parallelism (`tpkit.data_parallel`): the TP layout spread over the world.

Such a model's record holds what `data_parallel` did (`record.data_parallel`, read here by its attributes): the
inner model (the one whose state_dict keys are the original's), the tp communicator and the TP layout of every key. On disk the
checkpoint is the ordinary one: world rank `w` holds TP rank `w % tp_size`'s part (ranks are laid out as
`tpkit.comm.split` does), so spreading each TP layout over the world ranks makes every dp replica of a part a
"lower rank already holds it" case, and the writer's usual rule writes it once. FSDP2's dp shards (DTensors)
are gathered to the TP-local tensor for writing, and cut back to this rank's shard after reading.

A model that is one rank's stages of a pipeline (`tpkit.pipeline`: `record.pipeline`) holds only its stages' keys:
world ranks are laid out pp x dp x tp (tp innermost), so the `stage_size` consecutive ranks of its pipeline rank
hold each of its keys, spread over them as above, and every other rank holds none of it.

A context-parallel model (`tpkit.context_parallel`: `record.context`) holds the same TP parts on each of its cp
ranks: world = pp x dp x cp x tp (`tpkit.comm.groups`), tp still innermost, so its layouts are spread the same way
and its checkpoints do not depend on cp.

An expert-parallel model (`tpkit.expert_parallel`: `record.experts`) holds its experts' weights split along the
experts over its expert group: `ep` consecutive ranks of a stage (a multiple of tp), so world rank `w` holds expert
rank `w % ep`'s part, and each expert is written once, by the first expert group.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..layout import Piece, ShardLayout
from ..nn.record import find_record
from .errors import CheckpointError


def unwrap(model: nn.Module, comm) -> tuple[nn.Module, object | None]:
    """`(the model to read keys from, its data-parallel record or None)`; resharded, and checked against the
    world communicator `comm`."""
    found = find_record(model, "a checkpoint")
    record = found[1].data_parallel if found is not None else None
    pipe = found[1].pipeline if found is not None else None
    pp = pipe.pp_size if pipe is not None else 1
    cp = context_size(model)
    if record is not None and record.dp_size % cp == 0 and comm.world_size == record.tp_size * record.dp_size * pp:
        cp = 1  # the data-parallel engine runs over dp x cp (FSDP2 sharding over the cp ranks too)
    if record is not None and comm.world_size != record.tp_size * record.dp_size * pp * cp:
        raise CheckpointError(f"a {f'pp{pp} x ' if pipe is not None else ''}tp{record.tp_size} x dp{record.dp_size}"
                              f"{f' x cp{cp}' if cp > 1 else ''} model is saved and loaded with the world communicator "
                              f"({record.tp_size * record.dp_size * pp * cp} ranks); got one of {comm.world_size}")
    if record is None and pipe is not None and comm.world_size != pipe.stage_size * pp:
        raise CheckpointError(f"a pp{pp} x tp{found[1].world_size} model is saved and loaded with the world "
                              f"communicator ({pipe.stage_size * pp} ranks); got one of {comm.world_size}")
    if record is None:
        return model, None
    record.reshard()
    return record.module, record


def context_size(model: nn.Module) -> int:
    """The cp size of a context-parallel model (1 for any other)."""
    found = find_record(model, "a checkpoint")
    context = found[1].context if found is not None else None
    return context.comm.world_size if context is not None else 1


def spread_over(model: nn.Module, record, pipe) -> int | None:
    """The TP size whose layouts a save spreads over the world (the data-parallel record's, the pipeline's, a
    context-parallel model's), or None when the layouts are the world's already."""
    if record is not None:
        return record.tp_size
    if pipe is not None:
        return pipe.record.world_size
    found = find_record(model, "a checkpoint")
    spread_anyway = found is not None and (found[1].context is not None or found[1].experts is not None)
    return found[1].world_size if spread_anyway else None


def pipeline_of(model: nn.Module):
    """The pipeline facts of `model` (one rank's stages: `record.pipeline`), or None."""
    found = find_record(model, "a checkpoint")
    return found[1].pipeline if found is not None else None


def rng_comm(record, pipe, comm):
    """The communicator whose RNG tracker a checkpoint keeps: the tp group of a data-parallel model or a pipeline
    stage (its tracker seeds their dropout), else `comm`."""
    if record is not None and record.tp_comm is not None:
        return record.tp_comm
    return pipe.record.comm if pipe is not None and pipe.record.comm is not None else comm


def spread(layout: ShardLayout, tp_size: int, world: int, rank: int, stage_size: int | None = None) -> ShardLayout:
    """`layout` (over the tp ranks) as a layout over `world` ranks, rank `w` holding TP rank `w % tp_size`'s part;
    with `stage_size` (a pipeline stage's tensor), only the ranks of this rank's pipeline rank hold a split one (a
    whole one is written by the stage's first rank: `writer`)."""
    group, n = stage_size or world, layout.world_size  # tp_size, or an expert layout's ep (tp's multiple)
    assert n % tp_size == 0 and group % n == 0, f"a layout over {n} ranks spread over tp {tp_size}, {group} ranks"
    pieces = tuple(Piece(p.offset, p.size, tuple(p.spans[w % n] if w // group == rank // group else (0, 0)
                                                 for w in range(world))) for p in layout.pieces)
    return dataclasses.replace(layout, world_size=world, rank=rank, pieces=pieces)


def writer(rank: int, stage_size: int | None) -> int:
    """The world rank that writes the whole (replicated) tensors of `rank`'s model: 0, or the first rank of its
    pipeline stage."""
    return 0 if stage_size is None else rank // stage_size * stage_size


def whole_local(t: torch.Tensor) -> torch.Tensor:
    """The TP-local tensor of an FSDP2 shard (an all-gather over dp: collective, in the same order on every
    rank); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def is_sharded(t: torch.Tensor | None) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def put(dest: torch.Tensor, value: torch.Tensor) -> None:
    """Copy this rank's dp shard of the TP-local `value` into the DTensor `dest` (no communication)."""
    local = dest.to_local()
    with torch.no_grad():
        local.copy_(cut(value, dest).to(local.dtype))


def cut(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the TP-local `value`, placed as the DTensor `like` (each rank cuts its own part)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None).to_local()


def like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Optimizer state read as a TP-local tensor, as a DTensor sharded like `param` when `param` is one and the
    state has its shape (AdamW's moments); anything else unchanged."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor) or tuple(value.shape) != tuple(param.shape):
        return value
    return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
