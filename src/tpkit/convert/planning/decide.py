"""Steps 1 to 5 of `parallelize`: trace, plan, dry run, dataflow checks, expand. Together they decide the plan; no
step after them resolves it again.

The plan is decided on the state's `view`: the model itself, or, for a model whose blocks repeat, the model cut to
its distinct blocks (`trace.blocks.cut_view`: the trace, the planner, the dry run and the dataflow checks then cost
what those blocks cost, not what the whole stack costs), whose plan `expand_plan` gives every block
(`planning/reuse.py`). The cut is taken only where it is sure to decide what the whole model's trace would: "auto"
or overrides (never a whole plan the user wrote, nor sequence parallelism, which needs the whole trace), the
blocks' roles renamed for sure, and every override naming in the cut exactly the modules it names in the whole
model once renamed; and (checked by the plan step, before the dry run) every fact of its plan renamed for sure,
else the plan is made on the whole model's trace.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Mapping

from torch import nn

from ...comm.shapes import ShapeCommunicator
from ..plan import Plan
from ..state import AUTO, OVERRIDES, RECORDED, ConversionState, read_request, step, steps_once
from ..steps import prepare, resolved
from ..styles import REPLICATE, SEQUENCE_PARALLEL
from ..trace import Analysis, analyze_structure, untraced_structure
from ..trace.blocks import Blocks, analyze_blocks
from .dryrun import KEPT, dry_run
from .planner import auto_plan
from .reuse import enabled, expand, outside_blocks


# Thread-ranks of one process take turns at the steps that run the model's forward (the trace, the dry run): no
# collective runs there, and under the GIL two such runs at once took 40% longer than one after the other (each
# torch op hands the GIL over: a Llama-2-7B-shaped meta model, two ranks' conversions 0.25 s in turn, 0.35 s at
# once). Ranks in their own processes never wait here.
_TURNS = threading.RLock()


@step
def trace_model(s: ConversionState) -> ConversionState:
    """1. The analysis the plan is made from: none for a recorded plan (it was checked when it was made), the trace of
    the model cut to its distinct blocks where that decides the same plan, else the whole model's trace (under
    sequence parallelism on sequences that divide by the world size, for the dry run)."""
    if s.request.kind == RECORDED:
        return dataclasses.replace(s, view=s.model, analysis=untraced_structure(s.model))
    with _TURNS:
        return _traced(s)


def _traced(s: ConversionState) -> ConversionState:
    """`trace_model` of a plan still to make: the cut's trace, else the whole model's."""
    cut = _cut(s) if _may_cut(s) else None
    if cut is not None:
        analysis, blocks, outside, roles = cut
        return dataclasses.replace(s, view=analysis.model, blocks=tuple(blocks), outside=tuple(outside),
                                   analysis=analysis, roles=roles)
    seq = math.lcm(4, s.world) if s.sequence_parallel else 4
    return dataclasses.replace(s, view=s.model, analysis=analyze_structure(s.model, s.example_inputs, seq))


def _may_cut(s: ConversionState) -> bool:
    user = s.request.user
    return s.request.kind in (AUTO, OVERRIDES) and not s.sequence_parallel and enabled(s.reuse) and (
        user is None or SEQUENCE_PARALLEL not in user.entries.values())


def _cut(s: ConversionState) -> tuple[Analysis, list[Blocks], list[str], Mapping] | None:
    """(the cut's analysis, the repeated blocks, the cut's modules outside them (`reuse.outside_blocks`), the cut's
    roles renamed to every block), or None where the cut cannot stand for the whole model."""
    found = analyze_blocks(s.model, s.example_inputs)
    if found is None:
        return None
    short, blocks = found
    names = [n for n, _ in short.model.named_modules() if n]
    outside = outside_blocks(names, blocks)
    roles = expand(Plan(details=short.structures), blocks, outside)
    if roles is None:
        return None
    user = s.request.user
    if user is not None:
        whole_names = [n for n, _ in s.model.named_modules() if n]
        for pattern in user.entries:
            here = expand(Plan({n: REPLICATE for n in user.matching(pattern, names)}), blocks, outside)
            if here is None or set(here.entries) != set(user.matching(pattern, whole_names)):
                return None  # the override singles out a block the cut leaves out
    return short, blocks, outside, roles.details


@step
def make_plan(s: ConversionState) -> ConversionState:
    """2. The plan for the view, resolved once (`steps.resolved`): the planner's ("auto"), the planner's with the
    user's entries over it (those that name the view's modules, on a cut), or the user's whole plan. On a cut, this
    is where the cut is confirmed: its plan given to every block (kept in the state for step 5) must rename for sure,
    else the plan is made on the whole model's trace instead, so the steps after it never find the cut unsure."""
    plan = resolved(_planned(s), s.analysis, dict(s.view.named_modules()))
    if not s.cut:
        return dataclasses.replace(s, plan=plan)
    expanded = _expanded(s, plan)
    if expanded is not None:
        return dataclasses.replace(s, plan=plan, expanded=expanded)
    s = dataclasses.replace(s, view=s.model, blocks=(), outside=(), roles=None,
                            analysis=analyze_structure(s.model, s.example_inputs))
    return dataclasses.replace(s, plan=resolved(_planned(s), s.analysis, dict(s.model.named_modules())))


def _planned(s: ConversionState) -> Plan:
    user = s.request.user
    if s.request.kind not in (AUTO, OVERRIDES):
        return user
    plan = auto_plan(s.analysis, s.world, s.mode)
    if user is None:
        return plan
    names = [n for n, _ in s.view.named_modules() if n]
    return plan.updated(Plan({p: st for p, st in user.entries.items() if user.matching(p, names)}, prefix=user.prefix))


def _expanded(s: ConversionState, plan: Plan) -> Plan | None:
    """The cut's `plan` for every block (`reuse.expand`; the dry run's reasons copied as they are), or None."""
    return expand(plan, list(s.blocks), s.outside, verbatim=lambda reason: reason.startswith(KEPT))


@step
def dry_run_plan(s: ConversionState) -> ConversionState:
    """3. The converted view run once on a copy (`dryrun.dry_run`): what fails there is kept whole; a module the
    user's plan fixed that fails is a PlanError. A recorded plan was dry-run when it was made."""
    if s.request.kind == RECORDED:
        return s
    with _TURNS:
        plan = dry_run(s.view, s.plan, s.analysis, s.comm, s.sequence_parallel, s.request.fixed)
    return s if plan is s.plan else dataclasses.replace(s, plan=plan, expanded=None)  # a changed plan: expand anew


@step
def check_dataflow(s: ConversionState) -> ConversionState:
    """4. On a cut, the plan's dataflow checks on the cut (they need the trace, which the whole model does not get;
    a block past the cut sees what the block it copies sees). The model itself is checked when it is laid out."""
    if s.cut:
        prepare(s.view, s.plan.entries, s.plan.details, s.analysis, s.world, s.comm.rank, s.sequence_parallel)
    return s


@step
def expand_plan(s: ConversionState) -> ConversionState:
    """5. On a cut, the plan given to every block (`reuse.expand`) and the model's own analysis for the steps after
    (untraced, the cut's roles renamed to every block). The plan step made sure the planner's facts rename; the dry
    run since only replicated modules, with one reason for every block alike."""
    if not s.cut:
        return s
    plan = s.expanded if s.expanded is not None else _expanded(s, s.plan)
    if plan is None:  # not reachable by the argument above: a broken promise is a bug, not a silently other plan
        raise RuntimeError("tpkit: the plan of the model cut to its distinct blocks no longer renames to every block "
                           "after its dry run; convert with reuse=False and report this model")
    whole = dataclasses.replace(untraced_structure(s.model), structures=s.roles)
    return dataclasses.replace(s, view=s.model, analysis=whole, plan=plan)


def plan(model: nn.Module, world_size: int, *, mode: str = "inference", example_inputs: Any = None,
         overrides: Mapping[str, str] | Plan | None = None, analysis: Analysis | None = None,
         reuse: bool | None = None) -> Plan:
    """The tensor-parallel plan for `model` on `world_size` ranks (module name -> style; see `Plan`): `parallelize`'s
    steps 1 and 2 (trace, plan: on a cut, the plan given to every block there; no dry run, which needs a
    communicator's ranks to run on).

    `mode="training"` keeps the LM head's logits split over the vocabulary (pair it with
    `tpkit.nn.vocab_parallel_cross_entropy`); inference gathers them. `overrides` (a mapping or a Plan)
    take precedence over the automatic entries. The plan never depends on an HF config's
    `base_model_tp_plan`; `analyze` reports where that hint and this plan disagree. `analysis`: a structure
    analysis of `model` made before (then it is not traced again).

    `reuse` (default on; `TPKIT_PLAN_REUSE=0` turns it off): blocks that repeat a traced block's module types,
    shapes and settings take its plan entries without being traced (see `reuse.py`), so the plan's cost does
    not grow with depth; the result equals the whole trace's plan, which is made instead wherever unsure.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"plan: world_size must be a positive int, got {world_size!r}")
    wanted = dict(overrides.entries) if isinstance(overrides, Plan) else overrides
    with steps_once():
        request = read_request(wanted or "auto", dict(model.named_modules()), world_size)
        s = ConversionState(model, ShapeCommunicator(0, world_size), mode, request, example_inputs, reuse=reuse)
        s = make_plan(trace_model(s) if analysis is None else dataclasses.replace(s, view=model, analysis=analysis))
        return s.expanded if s.cut else s.plan
