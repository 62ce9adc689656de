"""`parallelize(model, plan, comm)`: swap a model's layers for this rank's `tpkit.nn` shards, in place.

Six named steps, each a function with a typed result:

1. trace    `trace.analyze_structure` -> `Analysis` (the dataflow, once per model);
2. plan     `resolve_plan` -> `Plan` (module -> style, as data; user entries over automatic ones; the
            registered families propose the automatic ones);
3. layouts  `layouts.plan_layouts` -> per module, one `ShardLayout` per tensor (type and size checks);
4. validate `validate.validate` -> the plan as a whole (each style's dataflow, ties, every family's checks);
5. swap     `swap.build` then `swap.swap`: new layers cut from those layouts, then put in, then every family
            installs what its styles need (`steps.prepare` / `steps.apply` hold steps 3 to 5);
6. finish   the `Conversion` record attached, and what stock tools call on the model answered for the whole
            model (`stock_calls.install`: full logits and attentions, a collective `save_pretrained`, the sentinel).

Between 2 and 3 the dry run (`dryrun.dry_run`) runs the converted structure once on the meta device and keeps
whole what its forward fails in (a user's plan that fails there is a PlanError).

A model whose blocks repeat (`trace/blocks.py`) is traced, planned, dry-run and dataflow-checked cut to its distinct
blocks, and that plan is expanded to every block (`planning/reuse.py`; `_reused` below), as `plan()` does: the trace and the
dry run then cost what two blocks cost, not what the whole stack costs. Wherever the renaming cannot vouch for the
result it gives None and the whole model is traced.

Everything is checked and every new layer is built before the first module is swapped, so an error leaves
the model exactly as it was. The result is one `Conversion` record: `model.tp_plan` is its plan, and
`tpkit.shard_layouts(model)` reads its layouts.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Mapping

from torch import nn

from ..nn._layer import resolve_comm
from ..nn.record import SplitsParameters, records_in
from ..quant import Quantization
from .peft import seam as peft_seam
from .peft.adapters import inner_model, lora_wrapped, parallelize_wrapped
from . import stock_calls
from .conversion import Conversion, attach
from .errors import PlanError
from .planning.dryrun import dry_run, fits_real_copy, real_first
from .layouts import check_grad_sums, key_layouts
from .advice.notices import log_kept_whole
from .plan import PLAN_WORDS, Plan, check_plan_argument
from .quantized import QuantizedLayers, record_layouts, refuse_quantized, with_units
from .planning.planner import auto_plan
from .registry import style
from .planning.reuse import enabled, expand, outside_blocks
from .steps import apply, prepare
from .styles import SEQUENCE_PARALLEL
from .trace import Analysis, analyze_structure, untraced_structure
from .trace.blocks import analyze_blocks, shortened


def resolve_plan(model: nn.Module, plan: Any, world_size: int, analysis: Analysis, mode: str) -> Plan:
    """`plan` as a Plan: "auto", a Plan (used as is), a JSON path, or a mapping of user entries (which
    override the automatic plan)."""
    check_plan_argument(plan)
    if isinstance(plan, str) and plan in PLAN_WORDS:
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
                example_inputs: Any = None, sequence_parallel: bool = False, recorded: bool = False,
                reuse: bool | None = None, quantization: Quantization | QuantizedLayers | None = None) -> nn.Module:
    """Convert `model` in place to this rank's tensor-parallel shard and return it.

    `plan`: "auto" (the planner's), a `Plan` (applied as is), a path to a plan JSON, or a mapping of user
    entries `{module name or glob: style}` that override the automatic plan. `comm`: the tensor-parallel
    communicator (default `tpkit.get_communicator()`). `mode="training"` keeps LM-head logits split over
    the vocabulary (use `tpkit.nn.vocab_parallel_cross_entropy`). Works on meta-device models (shards
    stay meta, to be loaded later). Raises before changing anything when the plan cannot be applied. Before any
    weight changes, the converted structure runs once on meta tensors (a real copy for a small model whose forward
    needs values) with the example inputs: a block that fails there stays whole, with the error as its reason in
    `model.tp_plan`; a plan the user wrote that fails there is a PlanError.

    `sequence_parallel=True` (or plan entries styled "sequence_parallel") also splits the residual stream
    along the sequence between row- and column-wise layers (see `sequence.py`; training mode, sequence length
    a multiple of the world size; the norms' partial gradients are summed in the backward).

    `recorded=True`: `plan` is the `Plan` this same model was converted with before at this world size (as a
    checkpoint records it); it is applied without tracing the model or re-checking the dataflow, which was
    done when it was made (reloads skip the trace). Ignored with sequence parallelism, which needs the trace.

    A model holding PEFT LoRA adapters (a `PeftModel`, or layers PEFT wrapped) converts as the bare model would,
    each adapter following its base layer's split (`tpkit.nn.lora`): the model `peft.get_peft_model` gives on the
    converted model.

    `reuse` (default on; `TPKIT_PLAN_REUSE=0` turns it off), as for `tpkit.plan`: with "auto" or a mapping of
    overrides, a model whose blocks repeat is traced and dry-run cut to its distinct blocks and the plan expanded
    to the others; the result equals the whole trace's (which is made instead wherever that is unsure, and always
    with sequence parallelism).

    `quantization`: a checkpoint's `QuantizedLayers` (`from_pretrained` passes it), whose layers are built holding
    the stored tensors, empty for a load to fill (`quantized.py`); or a bare `Quantization` (layers stay dense).
    Either way column / row pairs split in whole quantization groups where they can.
    """
    check_plan_argument(plan)
    refuse_quantized(model)
    comm = resolve_comm(comm)
    world, rank = comm.world_size, comm.rank
    peft_seam.install()  # PEFT's dispatch, files and loading know tpkit's layers, whenever PEFT is imported
    wrapped = lora_wrapped(inner_model(model))
    if wrapped:  # PEFT LoRA layers: convert the bare model, the adapters follow their base layers (`peft/adapters.py`)
        return parallelize_wrapped(model, wrapped, lambda bare: parallelize(
            bare, plan, comm, mode=mode, example_inputs=example_inputs, sequence_parallel=sequence_parallel,
            recorded=recorded, reuse=reuse), plan)
    done = [n or "the model" for n, _ in records_in(model)] + [
        n for n, m in model.named_modules() if isinstance(m, SplitsParameters) and m.split_dims()]
    if done:
        raise PlanError(f"parallelize: the model already holds tensor-parallel shards (e.g. {done[0]}); it was "
                        f"converted before (see its tp_plan). Convert the original model once per rank")
    recorded = recorded and isinstance(plan, Plan) and plan.world_size == world and not sequence_parallel and \
        SEQUENCE_PARALLEL not in plan.entries.values()
    reused = None
    if not recorded and not sequence_parallel and enabled(reuse):
        reused = _reused(model, plan, comm, mode, example_inputs)                        # 1. - 2b. on the cut
    if reused is not None:
        the_plan, analysis = reused
    else:
        # 1. trace (under sequence parallelism on sequences that divide by the world size, for the dry run)
        seq = math.lcm(4, world) if sequence_parallel else 4
        analysis = untraced_structure(model) if recorded else analyze_structure(model, example_inputs, seq)
        the_plan = resolve_plan(model, plan, world, analysis, mode)                       # 2. plan
        if not recorded:                                                                  # 2b. dry run
            the_plan = dry_run(model, the_plan, analysis, comm, sequence_parallel, _user_named(model, plan, analysis))
    quantized = quantization if isinstance(quantization, QuantizedLayers) else None
    if quantization is not None:
        the_plan = with_units(the_plan, model, quantized.quantization if quantized else quantization, world)
    # 3., 4. (after reuse step 4 ran on the cut, whose blocks stand for all; the analysis here has no trace)
    prepared = prepare(model, the_plan, analysis, world, rank, sequence_parallel, recorded or reused is not None)
    updates = apply(model, prepared, comm, quantized)                                     # 5. build, swap
    styles, per_module, modules = prepared.styles, prepared.layouts, prepared.modules
    kept = {n: s for n, s in styles.items()  # leaves, modules with layouts, containers acting as regions
            if n in analysis.leaves or n in per_module or style(s).region}
    record = Plan(kept, world_size=world, mode=the_plan.mode,
                  details=the_plan.details, reasons=the_plan.reasons, prefix=the_plan.prefix)
    layouts = {**key_layouts(model, modules, per_module, world, rank), **record_layouts(model)}
    _finish(model, Conversion(comm, layouts, plan=record, updated_attributes=updates, settled=prepared.checked))
    log_kept_whole(record, isinstance(plan, str) and plan in PLAN_WORDS, rank)
    return model


def _finish(model: nn.Module, conversion: Conversion) -> None:
    """6. The record on the model (its gradient sums checked), then what stock tools call on it (`stock_calls`)."""
    attach(model, conversion)
    check_grad_sums(model, "parallelize")
    stock_calls.install(model, conversion)


def _user_named(model: nn.Module, plan: Any, analysis: Analysis) -> Callable[[str], bool]:
    """Whether the user's `plan` named a module: every module for a whole plan, the entries' modules for a
    mapping of overrides, none for "auto"."""
    if isinstance(plan, str) and plan == "auto":
        return lambda name: False
    if isinstance(plan, Mapping) and "entries" not in plan:
        user = Plan.from_dict(plan)
        user.prefix = user.prefix or analysis.prefix
        named = set(user.resolve(_names(model)))
        return named.__contains__
    return lambda name: True


def _overrides(plan: Any) -> Plan | None:
    """The user's entries when `plan` is "auto" plus overrides (an empty Plan for "auto"); None for a whole plan,
    a path, or anything styled sequence parallel (which needs the whole trace)."""
    if isinstance(plan, str) and plan in PLAN_WORDS:
        return Plan()
    if isinstance(plan, Mapping) and not isinstance(plan, Plan) and "entries" not in plan:
        user = Plan.from_dict(plan)
        return None if SEQUENCE_PARALLEL in user.entries.values() else user
    return None


def _reused(model: nn.Module, plan: Any, comm, mode: str, example_inputs: Any) -> tuple[Plan, Analysis] | None:
    """Steps 1 to 2b on the model cut to its distinct blocks, the plan expanded to the whole model: (that plan, the
    whole model's analysis without a trace, its roles carried over from the cut), or None where reuse cannot vouch
    for the result (no repeated blocks, a fact the renaming is unsure of, overrides that single out a block the cut
    leaves out); then the caller traces the whole model.

    Sound because a block past the cut has the signature of the traced block it copies (its modules' classes,
    shapes, settings, the config's settings for its layer): the trace, the dataflow checks and the dry run's
    forward see in it what they see in that block, and the dry run keeps a failing module whole in every block
    alike. The overrides are resolved on the whole model first (naming no module raises as it would there); the
    cut gets those that name its modules, and its automatic plan with them, expanded, must equal the whole
    model's automatic plan with all of them."""
    user = _overrides(plan)
    if user is None:
        return None
    whole = untraced_structure(model)
    if user:
        user.prefix = user.prefix or whole.prefix
        user.resolve(_names(model))  # an entry naming no module raises, as on the whole trace
    found = analyze_blocks(model, example_inputs)
    if found is None:
        return None
    short, blocks = found
    world, copyable, tiny = comm.world_size, fits_real_copy(model), real_first(model)  # (of the whole model: the
    # cut is smaller)
    with shortened(model, blocks) as cut:
        names = _names(cut)
        outside = outside_blocks(names, blocks)
        short = dataclasses.replace(short, model=cut)
        small = auto_plan(short, world, mode)
        cut_user = Plan({p: s for p, s in user.entries.items() if user.matching(p, names)}, prefix=user.prefix)
        if user:
            auto, small = small, small.updated(cut_user)
            expanded, whole_auto = expand(small, blocks, outside), expand(auto, blocks, outside)
            if expanded is None or whole_auto is None or expanded.to_dict() != whole_auto.updated(user).to_dict():
                return None  # the overrides single out a block the cut leaves out
        fixed = _user_named(cut, dict(cut_user.entries) if user else "auto", short)
        small = dry_run(cut, small, short, comm, False, fixed, small=copyable, tiny=tiny)
        prepare(cut, small, short, world, comm.rank, False, False)  # step 4's dataflow checks (PlanError)
    result, roles = expand(small, blocks, outside), expand(Plan(details=short.structures), blocks, outside)
    if result is None or roles is None:
        return None
    return result, dataclasses.replace(whole, structures=roles.details)
