"""Which ranks are one data-parallel replica: the layout `tpkit.trainer` trains a converted model on.

The model's record says its tensor-parallel group; the rest of the world is data parallel, laid out as
`tpkit.comm.split` lays it (tp groups of consecutive ranks, tp innermost). Every rank of a tp group is one replica
to the Trainer: it gets that replica's rows, its gradients are averaged over dp only, and its metrics are gathered
over dp only.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from ..comm.communicator import Communicator
from ..comm.rank_groups import split
from ..comm.rebind import root_of
from ..nn.record import ModelRecord, find_record

DP_MODES = ("ddp", "fsdp")


class TrainerSetupError(ValueError):
    """A model, or training arguments, `tpkit.trainer` cannot train exactly; raised before anything is trained."""


@dataclasses.dataclass(frozen=True)
class TrainLayout:
    """This rank's groups: the world, its tensor-parallel group (the model's), its data-parallel group (None when
    the world is one replica) and how the dp dimension is run (`dp_mode`: "ddp" or "fsdp")."""

    world: Communicator
    tp: Communicator
    dp: Communicator | None
    dp_mode: str
    record: ModelRecord

    @property
    def tp_size(self) -> int:
        return self.tp.world_size

    @property
    def dp_size(self) -> int:
        return 1 if self.dp is None else self.dp.world_size

    @property
    def dp_rank(self) -> int:
        return 0 if self.dp is None else self.dp.rank


def layout_of(model: nn.Module, dp_mode: str) -> TrainLayout:
    """The layout of a converted `model` (collective over the world when dp > 1: it makes the dp groups). Raises
    `TrainerSetupError` for a model tpkit did not convert, a pipeline stage, a model already under data
    parallelism, or a tensor-parallel group that is not `tpkit.comm.split`'s."""
    import torch.distributed as dist

    found = find_record(model, "tpkit.trainer")
    if found is None or found[1].comm is None:
        raise TrainerSetupError("tpkit.trainer: the model holds no tensor-parallel layers; convert it first "
                                "(tpkit.from_pretrained(path, comm=tp) or tpkit.parallelize(model, comm=tp)), or use "
                                "transformers.Trainer for a model on one process")
    record = found[1]
    if record.pipeline is not None:
        raise TrainerSetupError("tpkit.trainer: the model is one stage of a pipeline (tpkit.pipeline); Trainer runs "
                                "one forward and backward per batch and cannot drive a pipeline schedule: train it "
                                "with its own step (pipe.step, examples/finetune.py --pp)")
    if record.data_parallel is not None:
        raise TrainerSetupError("tpkit.trainer: the model is already under data parallelism (tpkit.data_parallel); "
                                "pass the converted model itself: the Trainer puts it under DDP, or FSDP2 when the "
                                "training arguments ask for fsdp, over the data-parallel group")
    tp = record.comm
    if getattr(tp, "process_group", None) is None or not dist.is_initialized():
        raise TrainerSetupError(f"tpkit.trainer: the model was converted on {tp!r}, not on torch.distributed ranks; "
                                f"Trainer runs one process per rank: launch with torchrun (or tpkit.launch with "
                                f"backend 'gloo' / 'nccl') and convert on tpkit.init()'s communicator")
    world = root_of(tp)
    if world.world_size != dist.get_world_size():
        raise TrainerSetupError(f"tpkit.trainer: the model's communicator belongs to a world of {world.world_size} "
                                f"ranks; torch.distributed has {dist.get_world_size()}")
    if tp.world_size == world.world_size:
        return TrainLayout(world, tp, None, dp_mode, record)
    tp_split, dp = split(world, tp.world_size)
    if tp_split.name != tp.name:
        raise TrainerSetupError(f"tpkit.trainer: the model was converted on group {tp.name}, but the data-parallel "
                                f"layout puts rank {world.rank} in tensor-parallel group {tp_split.name} (consecutive "
                                f"ranks, tpkit.comm.split); convert on tp, dp = tpkit.comm.split(world, "
                                f"{tp.world_size})")
    return TrainLayout(world, tp, dp, dp_mode, record)
