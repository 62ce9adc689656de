"""`parallelize(model, plan, comm)`: swap a model's layers for this rank's `tpkit.nn` shards, in place.

Five named steps, each a function with a typed result:

1. trace    `planner.analyze_structure` -> `Analysis` (the dataflow, once per model);
2. plan     `resolve_plan` -> `Plan` (module -> style, as data; user entries over automatic ones);
3. layouts  `layouts.plan_layouts` -> per module, one `ShardLayout` per tensor (type and size checks);
4. validate `validate.validate` -> the plan as a whole (dataflow, ties, sequence-parallel region);
5. swap     `swap.build` then `swap.swap`: new layers cut from those layouts, then put in.

Everything is checked and every new layer is built before the first module is swapped, so an error leaves
the model exactly as it was. The result is one `Conversion` record: `model.tp_plan` is its plan, and
`tpkit.shard_layouts(model)` reads its layouts.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from ..layout import ShardLayout
from .errors import PlanError
from .fastpath import fast_path_updates
from .layouts import key_layouts, plan_layouts
from .plan import Plan
from .planner import auto_plan
from .structure import Analysis, analyze_structure, untraced_structure
from .styles import COLWISE, ROWWISE, SEQUENCE_PARALLEL, for_module, style
from .swap import attention_updates, build, swap
from .validate import validate


@dataclasses.dataclass
class Conversion:
    """What `parallelize` did on one rank: the plan it applied and what each tensor now holds."""

    plan: Plan
    layouts: dict[str, ShardLayout]        # state_dict key -> layout (every key, replicated ones included)
    updated_attributes: dict[str, dict]    # attention module -> attributes set to local head counts
    sequence_parallel: Any                 # the SequenceRegion, or None
    world_size: int
    rank: int


def resolve_plan(model: nn.Module, plan: Any, world_size: int, analysis: Analysis, mode: str) -> Plan:
    """`plan` as a Plan: "auto", a Plan (used as is), a JSON path, or a mapping of user entries (which
    override the automatic plan)."""
    if isinstance(plan, str) and plan == "auto":
        return auto_plan(analysis, world_size, mode)
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    if isinstance(plan, Plan):
        return plan.updated({})  # a copy: the caller's plan is not filled in with details
    if isinstance(plan, Mapping):
        user = Plan.from_dict(plan)
        user.prefix = user.prefix or analysis.prefix
        user.resolve(_names(model))
        if "entries" in plan:
            return user
        return auto_plan(analysis, world_size, mode).updated(user)
    raise PlanError(f"parallelize: plan must be 'auto', a Plan, a mapping or a JSON path, got {type(plan).__name__}")


def _names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_modules() if n]


def parallelize(model: nn.Module, plan: Any = "auto", comm=None, *, mode: str = "inference",
                example_inputs: Any = None, sequence_parallel: bool = False, recorded: bool = False) -> nn.Module:
    """Convert `model` in place to this rank's tensor-parallel shard and return it.

    `plan`: "auto" (the planner's), a `Plan` (applied as is), a path to a plan JSON, or a mapping of user
    entries `{module name or glob: style}` that override the automatic plan. `comm`: the tensor-parallel
    communicator (default `tpkit.get_communicator()`). `mode="training"` keeps LM-head logits split over
    the vocabulary (use `tpkit.nn.vocab_parallel_cross_entropy`). Works on meta-device models (shards
    stay meta, to be loaded later). Raises before changing anything when the plan cannot be applied.

    `sequence_parallel=True` (or plan entries styled "sequence_parallel") also splits the residual stream
    along the sequence between row- and column-wise layers (see `sequence.py`; training mode, sequence length
    a multiple of the world size; call `tpkit.nn.sync_sequence_parallel_grads(model)` after backward).

    `recorded=True`: `plan` is the `Plan` this same model was converted with before at this world size (as a
    checkpoint records it); it is applied without tracing the model or re-checking the dataflow, which was
    done when it was made (reloads skip the trace). Ignored with sequence parallelism, which needs the trace.
    """
    from ..nn._layer import resolve_comm

    comm = resolve_comm(comm)
    world, rank = comm.world_size, comm.rank
    done = [n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)]
    if done:
        raise PlanError(f"parallelize: the model already holds tensor-parallel shards (e.g. {done[0]}); it was "
                        f"converted before (see its tp_plan). Convert the original model once per rank")
    recorded = recorded and isinstance(plan, Plan) and plan.world_size == world and not sequence_parallel and \
        SEQUENCE_PARALLEL not in plan.entries.values()
    analysis = untraced_structure(model) if recorded else analyze_structure(model, example_inputs)  # 1. trace
    the_plan = resolve_plan(model, plan, world, analysis, mode)                           # 2. plan
    modules = dict(model.named_modules())
    styles = _styles(the_plan, analysis, modules)
    per_module = plan_layouts(modules, analysis.leaves, styles, the_plan.details, world, rank)  # 3. layouts
    region = None if recorded else validate(analysis, styles, world, sequence_parallel)  # 4. validate
    built = build(modules, styles, per_module, comm, set(region.rows) if region else set())   # 5. swap
    updates = attention_updates(model, styles, the_plan.details, world, rank)
    for name, attrs in fast_path_updates(model, styles, world).items():
        updates.setdefault(name, {}).update(attrs)
    swap(model, modules, analysis, styles, built, updates, region, comm, the_plan.details)
    kept = {n: s for n, s in styles.items()  # leaves, modules with layouts, containers with hooks (moe_block)
            if n in analysis.leaves or n in per_module or hasattr(style(s), "install")}
    record = Plan(kept, world_size=world, mode=the_plan.mode,
                  details=the_plan.details, reasons=the_plan.reasons, prefix=the_plan.prefix)
    record.updated_attributes, record.sequence_parallel, record.rank = updates, region, rank
    _record(model, Conversion(record, key_layouts(model, modules, per_module, world, rank), updates, region,
                              world, rank))
    return model


def _styles(the_plan: Plan, analysis: Analysis, modules: Mapping[str, nn.Module]) -> dict[str, str]:
    """`{module: canonical style}` for every module the plan names. User-written entries carry no head /
    packing facts: they are taken from the traced structure (into the plan's details)."""
    styles = {n: for_module(s, modules[n]) for n, s in the_plan.resolve(list(modules)[1:]).items()}
    for name, s in styles.items():
        if s in (COLWISE, ROWWISE) and name not in the_plan.details and name in analysis.structures:
            the_plan.details[name] = analysis.structures[name]
    return styles


def _record(model: nn.Module, conversion: Conversion) -> None:
    model._tp_conversion = conversion
    # Hugging Face models expose `tp_plan` as a validating property backed by `_tp_plan`.
    if isinstance(getattr(type(model), "tp_plan", None), property):
        model._tp_plan = conversion.plan
    else:
        model.tp_plan = conversion.plan
