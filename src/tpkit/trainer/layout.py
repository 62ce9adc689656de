"""Which ranks are one data-parallel replica: the layout `tpkit.trainer` trains a converted model on.

The model's record says its tensor-parallel group and, for a context-parallel model (`tpkit.context_parallel`), its
cp group; the rest of the world is data parallel, laid out as `tpkit.comm.groups` lays it (pp x dp x cp x tp, tp
innermost; with no cp, `tpkit.comm.split`). The tp x cp ranks of one dp index are one replica to the Trainer: they
get that replica's rows (a cp model takes the whole sequences on every cp rank and keeps its own tokens), their
gradients are averaged over dp only (the model sums them over cp itself), and their metrics are gathered over dp
only.

An expert-parallel model (`tpkit.expert_parallel`) keeps the same replicas: its experts are spread over expert groups
carved out of dp x cp x tp, and it reduces their gradients itself (summed over the ranks holding the same experts,
divided by dp; DDP and FSDP2 leave them alone). Its expert and expert-data groups, the dp size it divides by and the
tp group its experts share rows over must be those of `tpkit.comm.groups(world, tp, cp, ep)`.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from ..comm.communicator import Communicator
from ..comm.rank_groups import groups, split
from ..comm.rebind import root_of
from ..nn.record import ModelRecord, find_record

DP_MODES = ("ddp", "fsdp")


class TrainerSetupError(ValueError):
    """A model, or training arguments, `tpkit.trainer` cannot train exactly; raised before anything is trained."""


@dataclasses.dataclass(frozen=True)
class TrainLayout:
    """This rank's groups: the world, its tensor-parallel group (the model's; a group of one for a model that is only
    context-parallel), its data-parallel group (None when the world is one replica), how the dp dimension is run
    (`dp_mode`: "ddp" or "fsdp") and its context-parallel group (None for a model without cp)."""

    world: Communicator
    tp: Communicator
    dp: Communicator | None
    dp_mode: str
    record: ModelRecord
    cp: Communicator | None = None

    @property
    def tp_size(self) -> int:
        return self.tp.world_size

    @property
    def cp_size(self) -> int:
        return 1 if self.cp is None else self.cp.world_size

    @property
    def replica_size(self) -> int:
        """The ranks that see the same rows (tp x cp): what Trainer's counts over the world are divided by."""
        return self.tp_size * self.cp_size

    @property
    def dp_size(self) -> int:
        return 1 if self.dp is None else self.dp.world_size

    @property
    def dp_rank(self) -> int:
        return 0 if self.dp is None else self.dp.rank


def layout_of(model: nn.Module, dp_mode: str) -> TrainLayout:
    """The layout of a converted `model` (collective over the world when dp > 1 or cp / ep is used: it makes the
    groups). Raises `TrainerSetupError` for a model tpkit did not convert, a pipeline stage, a model already under
    data parallelism, or tp / cp / ep groups that are not `tpkit.comm.split`'s / `tpkit.comm.groups`'."""
    import torch.distributed as dist

    found = find_record(model, "tpkit.trainer")
    record = found[1] if found is not None else None
    context, experts = (record.context, record.experts) if record is not None else (None, None)
    if record is None or (record.comm is None and context is None and experts is None):
        raise TrainerSetupError("tpkit.trainer: the model holds no tensor-parallel layers; convert it first "
                                "(tpkit.from_pretrained(path, comm=tp) or tpkit.parallelize(model, comm=tp)), or use "
                                "transformers.Trainer for a model on one process")
    if record.pipeline is not None:
        raise TrainerSetupError("tpkit.trainer: the model is one stage of a pipeline (tpkit.pipeline); Trainer runs "
                                "one forward and backward per batch and cannot drive a pipeline schedule: train it "
                                "with its own step (pipe.step, examples/finetune.py --pp)")
    if record.data_parallel is not None:
        raise TrainerSetupError("tpkit.trainer: the model is already under data parallelism (tpkit.data_parallel); "
                                "pass the converted model itself: the Trainer puts it under DDP, or FSDP2 when the "
                                "training arguments ask for fsdp, over the data-parallel group")
    tp, cp, ep = record.comm, None if context is None else context.comm, None if experts is None else experts.ep
    for comm, what in ((tp, "converted"), (cp, "made context-parallel"), (ep, "made expert-parallel")):
        if comm is not None and (getattr(comm, "process_group", None) is None or not dist.is_initialized()):
            raise TrainerSetupError(f"tpkit.trainer: the model was {what} on {comm!r}, not on torch.distributed "
                                    f"ranks; Trainer runs one process per rank: launch with torchrun (or tpkit.launch "
                                    f"with backend 'gloo' / 'nccl') and convert on tpkit.init()'s communicator")
    world = root_of(next(c for c in (tp, cp, ep) if c is not None))
    if world.world_size != dist.get_world_size() or any(c is not None and root_of(c) is not world for c in (cp, ep)):
        raise TrainerSetupError(f"tpkit.trainer: the model's communicators belong to a world of {world.world_size} "
                                f"ranks; torch.distributed has {dist.get_world_size()}: make the tp, cp and ep groups "
                                f"with tpkit.comm.groups(tpkit.init(), tp=..., cp=..., ep=...)")
    if cp is not None or ep is not None:
        return _groups_layout(model, world, tp, cp, dp_mode, record)
    if tp.world_size == world.world_size:
        return TrainLayout(world, tp, None, dp_mode, record)
    tp_split, dp = split(world, tp.world_size)
    if tp_split.name != tp.name:
        raise TrainerSetupError(f"tpkit.trainer: the model was converted on group {tp.name}, but the data-parallel "
                                f"layout puts rank {world.rank} in tensor-parallel group {tp_split.name} (consecutive "
                                f"ranks, tpkit.comm.split); convert on tp, dp = tpkit.comm.split(world, "
                                f"{tp.world_size})")
    return TrainLayout(world, tp, dp, dp_mode, record)


def _groups_layout(model: nn.Module, world: Communicator, tp: Communicator | None, cp: Communicator | None,
                   dp_mode: str, record: ModelRecord) -> TrainLayout:
    """The layout of a cp and / or ep (x tp) model: one replica is the tp x cp ranks of one dp index of
    `tpkit.comm.groups`, whose tp, cp and expert groups the model's must be (the Trainer shards rows and averages
    gradients over its dp group: any other layout would give two ranks of one replica different rows, or divide the
    experts' gradients by another dp size than the one they are averaged over)."""
    tp_size, cp_size = 1 if tp is None else tp.world_size, 1 if cp is None else cp.world_size
    experts = record.experts
    ep_size = 1 if experts is None else experts.ep.world_size
    call = f"tp={tp_size}" + (f", cp={cp_size}" if cp is not None else "") + (f", ep={ep_size}" if experts else "")
    if world.world_size % (tp_size * cp_size):
        raise TrainerSetupError(f"tpkit.trainer: tp {tp_size} x cp {cp_size} = {tp_size * cp_size} does not divide "
                                f"the world of {world.world_size} ranks; choose sizes whose product divides it")
    try:
        mine = groups(world, tp=tp_size, cp=cp_size, ep=ep_size)
    except ValueError as exc:
        raise TrainerSetupError(f"tpkit.trainer: the model's groups are not tpkit.comm.groups(world, {call})'s: "
                                f"{exc}") from None
    have = [(_named(what, ours.name), _named(what, theirs.name)) for what, ours, theirs in (
        ("tensor-parallel", tp, mine.tp), ("context-parallel", cp, mine.cp)) if ours is not None]
    if experts is not None:
        edp = mine.edp.name if mine.edp is not None and mine.edp.world_size > 1 else None
        rows = _dispatch_tp(model, experts, mine.tp)
        have += [(_named("expert", experts.ep.name), _named("expert", mine.ep.name)),
                 (_named("expert-data", getattr(experts.edp, "name", None)), _named("expert-data", edp)),
                 (_named("experts' row-sharing", rows[0]), _named("experts' row-sharing", rows[1]))]
    wrong = [(ours, theirs) for ours, theirs in have if ours != theirs]
    if experts is not None and experts.dp != mine.dp.world_size:
        wrong.append((f"its experts' gradients divided by dp {experts.dp}", f"dp {mine.dp.world_size}"))
    if wrong:
        steps = ("convert on g.tp" + (" (plan=tpkit.KEEP_EXPERTS_WHOLE)" if experts else "")
                 + (", call tpkit.context_parallel(model, g.cp)" if cp is not None else "")
                 + (", then tpkit.expert_parallel(model, g)" if experts else ""))
        raise TrainerSetupError(
            "tpkit.trainer: the model has " + "; ".join(ours for ours, _ in wrong) + ", but the data-parallel layout "
            f"(tpkit.comm.groups: pp x dp x cp x tp, tp innermost) has rank {world.rank} in "
            + "; ".join(theirs for _, theirs in wrong) + f"; make the groups with g = tpkit.comm.groups(world, "
            f"{call}), {steps}")
    dp = mine.dp if mine.dp.world_size > 1 else None
    return TrainLayout(world, tp if tp is not None else mine.tp, dp, dp_mode, record, cp)


def _named(what: str, group: str | None) -> str:
    return f"{what} group {group if group is not None else '(none: each rank alone)'}"


def _dispatch_tp(model: nn.Module, experts, tp: Communicator) -> tuple[str | None, str | None]:
    """`(the group the expert-parallel modules share their rows over, the layout's tp group)` (None: no sharing)."""
    inner = model.get_submodule(find_record(model, "tpkit.trainer")[0])  # the converted model under a wrapper
    used = {getattr(getattr(inner.get_submodule(name), "tp", None), "name", None) for name in experts.modules}
    return (used.pop() if len(used) == 1 else str(sorted(map(str, used)))), (tp.name if tp.world_size > 1 else None)
