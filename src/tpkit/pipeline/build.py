"""`tpkit.pipeline`: a model cut into stages on torch's pipeline engine, each stage tensor- and data-parallel.

    pipe = tpkit.pipeline(model, comm, pp=2, tp=2, cp=1, schedule="1f1b", microbatches=4)
    opt = torch.optim.AdamW(pipe.model.parameters())
    loss = pipe.step(input_ids, labels)            # forward and backward of every micro-batch
    norm = tpkit.clip_grad_norm_(pipe.model.parameters(), 1.0)
    opt.step(); opt.zero_grad()

In order, before anything runs: the split (`split.py`), the ties across the first and last stage (`tied.py`), the
groups (`layout.py`: world = pp x dp x cp x tp, tp innermost), the whole model's tensor-parallel plan
(`compose.py`), and with cp > 1 a dry run of `tpkit.context_parallel` on a weightless copy (what it refuses is
refused here); then the model is cut to this rank's part (`stage.py`), converted on the tp group, made
context-parallel over the cp group (each stage cuts every micro-batch's sequences itself:
`tpkit.context.pipeline`), its stage modules put under FSDP2 or DDP over the dp group, and handed to torch's
`PipelineStage` and schedule (`schedule.py`). A path (a Hugging Face directory or a tpkit checkpoint) is built on
the meta device, cut and converted the same way, and each rank reads only its part's tensors, and of those its tp
slices (`tpkit.from_pretrained`'s reader).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Sequence

import torch
from torch import nn

from ..checkpoint import from_pretrained
from ..comm.communicator import Communicator
from ..context import context_parallel
from ..convert.families.experts import experts_in
from ..experts import KEEP_EXPERTS_WHOLE, expert_parallel
from ..experts.aux_loss import aux_loss_on
from ..context.pipeline import StageContext
from ..nn._layer import resolve_comm
from ..nn.record import find_record
from .compose import convert_part, converted_plan, data_parallel_stages, weightless_copy
from .layout import pipeline_groups
from .parallel import PipelineParallel
from .run import CausalLMLoss, Pipeline, SwitchedLoss
from .schedule import SINGLE, check_schedule, make_schedule, rank_stages, stage_rank
from .split import split_stages
from .stage import StageModule, prune, stage_modules
from .tied import TiedCopies, tied_groups, tied_pairs, untie


@dataclasses.dataclass(frozen=True)
class Cut:
    """How the model is cut and laid out (the arguments of `pipeline` that `prepare` needs)."""

    comm: Communicator
    pp: int
    tp: int
    schedule: str
    stages_per_rank: int
    starts: Sequence[int] | None
    mode: str
    cp: int = 1
    cp_method: str = "auto"
    ep: int = 1


def pipeline(model: nn.Module | str | os.PathLike, comm: Communicator | None = None, *, pp: int, tp: int = 1,
             cp: int = 1, cp_method: str = "auto", ep: int = 1, schedule: str = "1f1b", microbatches: int | None = None,
             stages_per_rank: int | None = None, starts: Sequence[int] | None = None, dp_mode: str = "fsdp",
             mode: str = "training", loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             dtype=None, device: torch.device | str | int | None = None) -> Pipeline:
    """Cut `model` (in place) into `pp x stages_per_rank` stages over the world `comm` (default
    `tpkit.get_communicator()`, a torch backend) laid out as pp x dp x cp x tp (`tpkit.pipeline_groups`), and
    return this rank's `Pipeline`. `model.parameters()` are this rank's afterwards (also `Pipeline.model`). `model`
    may be a path (a Hugging Face directory or a tpkit checkpoint): each rank then reads only its part, in `dtype`
    (as `tpkit.from_pretrained`'s), onto `device`.

    `schedule`: "gpipe", "1f1b" (one stage per rank), "interleaved1f1b", "looped_bfs", "interleaved_zb" (several;
    default 2), "zbv" (two). `microbatches` (default pp x stages_per_rank) must divide the batch. `starts`: the
    first block of each stage (default: balanced by cost and memory, `tpkit.split_stages`). `cp`: each micro-batch's
    sequences split over this many ranks inside every stage (`tpkit.context_parallel(..., method=cp_method)` on each
    rank's part; the batch given to `Pipeline.step` is whole sequences, on every rank). `dp_mode`: FSDP2 or DDP over
    dp = world / (pp x cp x tp). `mode`: as `parallelize`'s ("training": the LM head's logits stay split over the
    vocabulary and the loss is computed on them). `loss_fn(output, labels)`: default, a Hugging Face causal LM's
    own loss (the only one under cp > 1). `ep`: a MoE model's experts spread over this many ranks of each stage's
    dp x cp x tp (`tpkit.expert_parallel` on each rank's part). Raises before anything changes when the model cannot
    be cut as asked."""
    comm = resolve_comm(comm)
    if getattr(comm, "process_group", None) is None:
        raise TypeError(f"pipeline: comm must be a torch-backend communicator (tpkit.init()); got "
                        f"{type(comm).__name__}: torch's pipeline stages send over torch.distributed")
    v = stages_per_rank if stages_per_rank is not None else (1 if schedule in SINGLE else 2)
    check_schedule(schedule, v)
    m = microbatches if microbatches is not None else pp * v
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"pipeline: microbatches must be a positive int, got {microbatches!r}")
    if cp != 1 and loss_fn is not None:
        raise ValueError(f"pipeline: cp {cp} with a loss_fn: under context parallelism the last stage holds the "
                         f"logits of this rank's tokens only, and the loss must shift the labels over the whole "
                         f"sequence and sum the ranks' shares; leave loss_fn out (the model's own causal LM loss)")
    cut = Cut(comm, pp, tp, schedule, v, starts, mode, cp, cp_method, ep)
    if isinstance(model, (str, os.PathLike)):
        made: list[PipelineParallel] = []
        part = from_pretrained(model, comm, mode=mode, dtype=dtype, device=device,
                               convert=lambda built: made.append(prepare(built, cut)))
        facts = made[0]
        if facts.tied is not None:
            facts.tied.own_memory(part)
    else:
        part, facts = model, prepare(model, cut)
    return _run_stages(part, facts, m, dp_mode, loss_fn, cut.cp_method)


def prepare(model: nn.Module, cut: Cut) -> PipelineParallel:
    """Cut `model` in place to this rank's part, converted on its tp group; its pipeline facts, kept in its record.
    Everything that can refuse (the split, the ties, the layout) runs before anything changes."""
    if find_record(model, "pipeline") is not None:
        raise ValueError("pipeline: the model is converted already; pass the original model (each stage is "
                         "converted on its tensor-parallel group)")
    if getattr(getattr(model, "config", None), "quantization_config", None):
        raise ValueError("pipeline: quantized models are not cut into pipeline stages; load them with "
                         "tpkit.from_pretrained (tensor parallelism)")
    pp, n = cut.pp, cut.pp * cut.stages_per_rank
    split = split_stages(model, n, cut.starts)
    pairs = tied_pairs(model, split)
    groups = pipeline_groups(cut.comm, pp, cut.tp, cut.cp, cut.ep)
    mine = rank_stages(groups.pp_rank, n, pp, cut.schedule)
    first, last = stage_rank(0, n, pp, cut.schedule), stage_rank(n - 1, n, pp, cut.schedule)
    tied_comm = tied_groups(cut.comm, pairs, first, last, groups.pp_rank, groups.dp.world_size, cut.tp, cut.cp)
    keys = frozenset(model.state_dict().keys())
    plan = converted_plan(model, groups.tp, cut.mode, KEEP_EXPERTS_WHOLE if cut.ep > 1 else "auto") \
        if cut.tp > 1 else None
    if groups.cp_size > 1:  # what context_parallel refuses (method, attention kernel, layers) refused now
        context_parallel(weightless_copy(model), groups.cp, cut.cp_method)
    if groups.ep is not None:  # and what expert_parallel refuses (no experts, fewer experts than ep, the aux loss)
        expert_parallel(weightless_copy(model), groups)
        if aux_loss_on(model) and groups.dp.world_size > 1:
            raise NotImplementedError(f"pipeline: ep {cut.ep} with the router's auxiliary loss (output_router_logits): "
                                      f"tpkit computes it over the global batch only without a pipeline (the loss is "
                                      f"on the last stage, the router logits on every stage); turn it off")
    if pairs and first == last == groups.pp_rank:
        untie(model, pairs)
    prune(model, split, mine)
    record = convert_part(model, plan, groups.tp, cut.mode)
    tied = _tied(pairs, tied_comm, groups.pp_rank, first, last)
    facts = PipelineParallel.of(groups, split, tuple(mine), cut.schedule, tied, keys, record, plan)
    record.pipeline = facts
    if groups.ep is not None and experts_in(model)[0]:
        expert_parallel(model, groups)  # this stage's experts over its expert group: a load reads only this rank's
    return facts


def _tied(pairs, comm, pp_rank: int, first: int, last: int) -> TiedCopies | None:
    """This rank's side of the tied pairs, or None when it holds neither."""
    if not pairs or pp_rank not in (first, last):
        return None
    role = "both" if first == last else "first" if pp_rank == first else "last"
    return TiedCopies(tuple(pairs), role, comm)


def _run_stages(part: nn.Module, facts: PipelineParallel, microbatches: int, dp_mode: str, loss_fn,
                cp_method: str) -> Pipeline:
    """torch's `PipelineStage`s and schedule over the part's stage modules (made context-parallel when cp > 1, under
    data parallelism when dp > 1)."""
    from torch.distributed.pipelining import PipelineStage

    groups = facts.groups
    context = None
    if groups.cp_size > 1:  # after the tp conversion (the cp sums wrap TP's) and the read; before FSDP2 / DDP
        context_parallel(part, groups.cp, cp_method)
        context = StageContext(part)
    modules: list[nn.Module] = list(stage_modules(part, facts.split, list(facts.stages), context))
    views: list[StageModule] = list(modules)  # type: ignore[arg-type]
    if groups.dp.world_size > 1:
        modules = data_parallel_stages(part, views, facts.split, groups.dp, dp_mode, facts.record)
    device = next(part.parameters()).device
    n = facts.split.num_stages
    stages = [PipelineStage(mod, s, n, device, group=groups.pp.process_group)
              for mod, s in zip(modules, facts.stages)]
    loss = SwitchedLoss(loss_fn if loss_fn is not None else CausalLMLoss(part, groups.cp))
    schedule = make_schedule(facts.schedule, stages, microbatches, loss)
    return Pipeline(part, views, schedule, facts, microbatches, loss)
