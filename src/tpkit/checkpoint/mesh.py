"""Checkpoints of models under data parallelism (`tpkit.data_parallel`): the TP layout spread over the world.

Such a model's record holds what `data_parallel` did (`record.data_parallel`, read here by its attributes): the
inner model (the one whose state_dict keys are the original's), the tp communicator and the TP layout of every key. On disk the
checkpoint is the ordinary one: world rank `w` holds TP rank `w % tp_size`'s part (ranks are laid out as
`tpkit.comm.split` does), so spreading each TP layout over the world ranks makes every dp replica of a part a
"lower rank already holds it" case, and the writer's usual rule writes it once. FSDP2's dp shards (DTensors)
are gathered to the TP-local tensor for writing, and cut back to this rank's shard after reading.
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
    if record is None:
        return model, None
    if comm.world_size != record.tp_size * record.dp_size:
        raise CheckpointError(f"a tp{record.tp_size} x dp{record.dp_size} model is saved and loaded with the world "
                              f"communicator ({record.tp_size * record.dp_size} ranks); got one of {comm.world_size}")
    record.reshard()
    return record.module, record


def spread(layout: ShardLayout, tp_size: int, world: int, rank: int) -> ShardLayout:
    """`layout` (over the tp ranks) as a layout over `world` ranks, rank `w` holding TP rank `w % tp_size`'s part."""
    pieces = tuple(Piece(p.offset, p.size, tuple(p.spans[w % tp_size] for w in range(world))) for p in layout.pieces)
    return dataclasses.replace(layout, world_size=world, rank=rank, pieces=pieces)


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
