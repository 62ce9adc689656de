"""Steps 3 to 5 of `parallelize` on one model: layouts, validate, build and swap, as two functions the real
conversion and its dry run (`planning/dryrun.py`, on a meta copy) share.

`prepare` only reads (a failure is a PlanError with the model untouched); `apply` builds every new layer, then
changes the model.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from torch import nn

from .family import Checked, Planned
from .layouts import plan_layouts
from .plan import Plan
from .quantized import QuantizedLayers
from .registry import STYLES, for_module
from .styles import COLWISE, ROWWISE, Layouts
from .swap import attribute_updates, build, swap
from .trace import Analysis
from .validate import validate


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A plan checked against one model on one rank: what `apply` needs."""

    modules: Mapping[str, nn.Module]       # the model's modules before the swap
    styles: Mapping[str, str]
    layouts: Mapping[str, Layouts]         # per module, its tensors' layouts
    planned: Planned
    checked: Mapping[str, Checked]
    options: Mapping[str, Mapping]         # extra keyword arguments of a module's build


def prepare(model: nn.Module, the_plan: Plan, analysis: Analysis, world: int, rank: int,
            sequence_parallel: bool, recorded: bool) -> Prepared:
    """Steps 3 (layouts) and 4 (validate); changes nothing in the model. `recorded`: skip step 4, whose checks need
    the trace (a recorded plan was checked when it was made; a reused one on the model cut to its distinct blocks)."""
    modules = dict(model.named_modules())
    styles = plan_styles(the_plan, analysis, modules)
    per_module = plan_layouts(modules, analysis.leaves, styles, the_plan.details, world, rank)
    planned = Planned(model, analysis, styles, the_plan.details, world, rank, STYLES, sequence_parallel)
    checked = {} if recorded else validate(planned)
    for c in checked.values():
        styles.update(c.styles)
    options: dict[str, dict] = {}
    for c in checked.values():
        for name, kwargs in c.build.items():
            options.setdefault(name, {}).update(kwargs)
    return Prepared(modules, styles, per_module, planned, checked, options)


def apply(model: nn.Module, p: Prepared, comm, quantized: QuantizedLayers | None = None) -> dict[str, dict]:
    """Step 5: build every new layer (`quantized`: the layers a checkpoint stores quantized), then swap them in;
    returns the attribute updates made."""
    built = build(p.modules, p.styles, p.layouts, comm, p.options, quantized)
    updates = attribute_updates(p.planned)
    swap(model, p.modules, p.planned, built, updates, p.checked, comm)
    return updates


def plan_styles(the_plan: Plan, analysis: Analysis, modules: Mapping[str, nn.Module]) -> dict[str, str]:
    """`{module: canonical style}` for every module the plan names. User-written entries carry no head /
    packing facts: they are taken from the traced structure (into the plan's details)."""
    styles = {n: for_module(s, modules[n]) for n, s in the_plan.resolve(list(modules)[1:]).items()}
    for name, s in styles.items():
        if s in (COLWISE, ROWWISE) and name not in the_plan.details and name in analysis.structures:
            the_plan.details[name] = analysis.structures[name]
    return styles
