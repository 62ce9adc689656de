"""Composing a pipeline stage with tensor and data parallelism: the rank's part converted on its tp group with
the whole model's plan, then its stage modules under FSDP2 or DDP over its dp group.

The plan: a weightless (meta) copy of the whole model is converted on the tp group first (`converted_plan`: the
trace, the planner and the dry run see the model whole, as `tpkit.parallelize` would), and its recorded plan,
cut to the modules the rank's part still holds, is applied to the part (`parallelize(..., recorded=True)`: no
trace, which a part, missing layers, could not run). Each rank's part is then exactly its share of the model
`parallelize` converts whole.

Data parallelism: torch's pipeline stages run their module under DDP (`no_sync` until the last micro-batch) or
FSDP2 (gradient sync on the last backward), so each stage module is wrapped on its own (FSDP2: each block, then the
stage module as the root); the part's record keeps the engine (`record.data_parallel`, the stage modules as its
roots) for the norm, the checkpoints and the sentinel, exactly as `tpkit.data_parallel` does for a whole model.
"""
from __future__ import annotations

import copy

from torch import nn

from ..comm.communicator import Communicator
from ..convert import Plan, parallelize
from ..data_parallel import DataParallel, device_type, expert_params, shard_experts
from ..nn.decode import adopt_decode_paths
from ..nn.record import ModelRecord, attach_record, find_record
from .split import StageSplit
from .stage import HeldElsewhere, StageModule


def weightless_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose parameters are on the meta device (buffers copied: they are small, and a
    model's forward may need their values)."""
    memo = {id(p): nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad) for p in model.parameters()}
    return copy.deepcopy(model, memo)


def converted_plan(model: nn.Module, tp: Communicator, mode: str, plan="auto") -> Plan:
    """The plan `tpkit.parallelize` applies to the whole `model` on `tp` (converted as a weightless copy; `plan`:
    "auto", or overrides such as `tpkit.KEEP_EXPERTS_WHOLE` for expert parallelism)."""
    whole = weightless_copy(model)
    parallelize(whole, plan, tp, mode=mode)
    return whole.tp_plan


def part_plan(plan: Plan, part: nn.Module) -> Plan:
    """`plan` cut to the modules `part` holds (none inside a placeholder)."""
    names = {n for n, m in part.named_modules() if not isinstance(m, HeldElsewhere)}
    keep = lambda d: {k: v for k, v in d.items() if k in names}  # noqa: E731
    return Plan(keep(plan.entries), world_size=plan.world_size, mode=plan.mode, details=keep(plan.details),
                reasons=keep(plan.reasons), prefix=plan.prefix, replaced_by_forward=plan.replaced_by_forward)


def convert_part(part: nn.Module, plan: Plan | None, tp: Communicator, mode: str) -> ModelRecord:
    """Convert the rank's part on `tp` with the whole model's `plan` (None at tp 1: the part gets a plain record);
    return its record."""
    if plan is not None and tp.world_size > 1:
        parallelize(part, part_plan(plan, part), tp, mode=mode, recorded=True)
        return find_record(part, "pipeline")[1]
    adopt_decode_paths(part)  # whole: its Linear layers multiply at decode as a conversion's do
    return attach_record(part, ModelRecord(tp, {}))


def data_parallel_stages(part: nn.Module, stages: list[StageModule], split: StageSplit, dp: Communicator,
                         mode: str, record: ModelRecord) -> list[nn.Module]:
    """Each stage module under FSDP2 (`mode="fsdp"`: its blocks, then itself) or DDP over `dp`; the modules
    torch's `PipelineStage` runs. The engine is kept in the part's record."""
    if mode not in ("fsdp", "ddp"):
        raise ValueError(f"pipeline: dp_mode {mode!r} is not 'fsdp' or 'ddp'")
    if mode == "fsdp":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(dp.process_group, device_type(dp))
        # experts: sharded over their expert-data group (or, held once, left to their own gradient rule)
        ignored = set() if shard_experts(record, {}) else set(expert_params(part, record).values())
        for stage in stages:
            blocks = stage.module.get_submodule(split.blocks)
            for i in split.stage_blocks(stage.stage):
                fully_shard(blocks[i], mesh=mesh, ignored_params=ignored)
            fully_shard(stage, mesh=mesh, ignored_params=ignored)
        wrapped: list[nn.Module] = list(stages)
    else:
        from torch.nn.parallel import DistributedDataParallel

        # find_unused_parameters=True: DDP then never rebuilds its buckets, which torch 2.13 gets wrong under a
        # pipeline schedule (it counts the parameters of every micro-batch's backward and fails the second step)
        for s in stages:
            names = sorted(expert_params(s, record))
            if names:
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(s, names)
        wrapped = [DistributedDataParallel(s, process_group=dp.process_group, find_unused_parameters=True)
                   for s in stages]
    record.data_parallel = DataParallel.of(mode, part, dp, record, roots=tuple(stages))
    return wrapped
