"""The steps of `parallelize` after the plan is decided: quantization units, layouts and checks, build and swap,
record; and the function they share with the dry run (`planning/dryrun.py`, on a copy).

`resolved` turns a plan into module names and canonical styles, once (`planning/decide.py` calls it when it makes
the plan); every later step reads those entries as they are. `prepare` only reads (a failure is a PlanError with
the model untouched); `swap.swap` builds every new layer, then changes the model.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from torch import nn

from . import stock_calls
from .advice.notices import log_kept_whole
from .conversion import Conversion, attach
from .family import Planned
from .layouts import key_layouts, plan_layouts
from .plan import Plan
from .quantized import QuantizedLayers, record_layouts, with_units
from .registry import STYLES, for_module, style
from .roles import Role
from .state import AUTO, ConversionState, step
from .styles import COLWISE, ROWWISE
from .swap import Prepared, swap
from .trace import Analysis
from .validate import validate


def resolved(the_plan: Plan, analysis: Analysis, modules: Mapping[str, nn.Module]) -> Plan:
    """`the_plan` against `modules`: an entry per module it names (globs and the base-model prefix resolved), each a
    canonical style for that module's type. User-written entries carry no head / packing facts: they are taken from
    the traced structure (into the plan's details). Raises PlanError for an entry naming no module."""
    styles = {n: for_module(s, modules[n]) for n, s in the_plan.resolve(list(modules)[1:]).items()}
    details = dict(the_plan.details)
    for name, s in styles.items():
        if s in (COLWISE, ROWWISE) and name not in details and name in analysis.structures:
            details[name] = analysis.structures[name]
    return the_plan.replaced(styles, details)


def prepare(model: nn.Module, styles: Mapping[str, str], details: Mapping[str, Role], analysis: Analysis,
            world: int, rank: int, sequence_parallel: bool) -> Prepared:
    """Layouts and checks of resolved `styles`; changes nothing in the model. The checks read the trace where
    `analysis` has one (each style's dataflow); every family settles what its install needs either way."""
    modules, styles = dict(model.named_modules()), dict(styles)
    per_module = plan_layouts(modules, analysis.leaves, styles, details, world, rank)
    planned = Planned(model, analysis, styles, details, world, rank, STYLES, sequence_parallel)
    checked = validate(planned)
    for c in checked.values():
        styles.update(c.styles)  # (what the families settled: the swap and the installs read them through `planned`)
    options: dict[str, dict] = {}
    for c in checked.values():
        for name, kwargs in c.build.items():
            options.setdefault(name, {}).update(kwargs)
    return Prepared(modules, styles, per_module, planned, checked, options)


@step
def quantization_units(s: ConversionState) -> ConversionState:
    """6. A quantized model's column / row pairs split in whole quantization groups (`quantized.with_units`); the
    state passes through without quantization."""
    if s.quantization is None:
        return s
    quant = s.quantization.quantization if isinstance(s.quantization, QuantizedLayers) else s.quantization
    return dataclasses.replace(s, plan=with_units(s.plan, dict(s.model.named_modules()), quant, s.world))


@step
def lay_out(s: ConversionState) -> ConversionState:
    """7. This rank's layouts of every planned tensor, and the checks of the plan as a whole (`prepare`)."""
    prepared = prepare(s.model, s.plan.entries, s.plan.details, s.analysis, s.world, s.comm.rank,
                       s.sequence_parallel)
    return dataclasses.replace(s, prepared=prepared)


@step
def build_and_swap(s: ConversionState) -> ConversionState:
    """8. Every new layer built, then swapped in (the first change to the model)."""
    quantized = s.quantization if isinstance(s.quantization, QuantizedLayers) else None
    return dataclasses.replace(s, updates=swap(s.model, s.prepared, s.comm, quantized))


def replaced_by_forward(before: Mapping[str, type], modules: Mapping[str, nn.Module]) -> list[str]:
    """Modules whose class changed during the conversion other than by tpkit's swap (which installs tpkit's own
    classes, or subclasses of a module's class): the model's own forward replaced them in the trace."""
    return [n for n, cls in before.items() if n in modules and not isinstance(modules[n], cls)
            and not type(modules[n]).__module__.startswith("tpkit.")]


@step
def record(s: ConversionState) -> Conversion:
    """9. The `Conversion` record on the model (the plan as applied, every tensor's layout), what stock tools call
    answered for the whole model (`stock_calls`), and the modules kept whole logged."""
    p, analysis = s.prepared, s.analysis
    kept = {n: st for n, st in p.styles.items()  # leaves, modules with layouts, containers acting as regions
            if n in analysis.leaves or n in p.layouts or style(st).region}
    modules = dict(s.model.named_modules())  # the converted model, walked once for its layouts and stock calls
    applied = Plan(kept, world_size=s.world, mode=s.plan.mode, details=s.plan.details, reasons=s.plan.reasons,
                   prefix=s.plan.prefix, replaced_by_forward=replaced_by_forward(s.classes, modules))
    layouts = {**key_layouts(modules, s.model.state_dict(keep_vars=True), p.layouts, s.world, s.comm.rank),
               **record_layouts(modules)}
    conversion = Conversion(s.comm, layouts, plan=applied, updated_attributes=s.updates, settled=p.checked)
    attach(s.model, conversion)
    stock_calls.install(s.model, conversion, modules)
    log_kept_whole(applied, s.request.kind == AUTO, s.comm.rank)
    return conversion

