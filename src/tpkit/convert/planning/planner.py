"""Step 2 of conversion (plan): from a structure `Analysis` to a `Plan` for a world size.

Every registered family (`registry.FAMILIES`, in order) proposes entries for the groups of modules it owns, each
with its alternatives; the chosen alternative (the default unless `choose` names another) is applied before the
next proposal is asked for. Every layer no family split stays replicated, with the reason.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from torch import nn

from ..family import Draft, Proposal
from ..plan import Plan
from ..registry import STYLES, families
from .reuse import enabled, expand, outside_blocks
from ..styles import REPLICATE
from ..trace import Analysis, analyze_structure, parameterised_leaves
from ..trace.blocks import analyze_blocks, shortened

MODES = ("inference", "training")


def propose(a: Analysis, world_size: int, mode: str = "inference",
            choose: Mapping[str, str] | None = None) -> tuple[Plan, list[Proposal]]:
    """The plan for `world_size` ranks and every proposal made on the way (with its alternatives); `choose`
    maps a proposal's key to the alternative to take instead of its family's default."""
    if mode not in MODES:
        raise ValueError(f"plan: mode must be 'inference' or 'training', got {mode!r}")
    draft = Draft(a, world_size, mode, choose, STYLES)
    if a.trace is None:
        why = f"the model's forward could not be traced ({a.trace_error}); pass example_inputs"
        return Plan({n: REPLICATE for n in a.leaves}, world_size=world_size, mode=mode,
                    reasons={n: why for n in a.leaves}, prefix=a.prefix), []
    for family in families():
        for proposal in family.propose(draft, family.detect(a)):
            draft.apply(proposal)
    for name in a.leaves:
        if name not in draft.entries:
            draft.entries[name] = REPLICATE
            draft.reasons[name] = draft.reason(name)
    plan = Plan(draft.entries, world_size=world_size, mode=mode, details=draft.details, reasons=draft.reasons,
                prefix=a.prefix)
    return plan, draft.proposals


def auto_plan(a: Analysis, world_size: int, mode: str = "inference", choose: Mapping[str, str] | None = None) -> Plan:
    """The automatic plan for `world_size` ranks from a structure analysis."""
    return propose(a, world_size, mode, choose)[0]


def plan(model: nn.Module, world_size: int, *, mode: str = "inference", example_inputs: Any = None,
         overrides: Mapping[str, str] | Plan | None = None, analysis: Analysis | None = None,
         reuse: bool | None = None) -> Plan:
    """The tensor-parallel plan for `model` on `world_size` ranks (module name -> style; see `Plan`).

    `mode="training"` keeps the LM head's logits split over the vocabulary (pair it with
    `tpkit.nn.vocab_parallel_cross_entropy`); inference gathers them. `overrides` (a mapping or a Plan)
    take precedence over the automatic entries. The plan never depends on an HF config's
    `base_model_tp_plan`; `analyze` reports where that hint and this plan disagree.

    `reuse` (default on; `TPKIT_PLAN_REUSE=0` turns it off): blocks that repeat a traced block's module types,
    shapes and settings take its plan entries without being traced (see `reuse.py`), so the plan's cost does
    not grow with depth; the result equals the whole trace's plan, which is made instead wherever unsure.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"plan: world_size must be a positive int, got {world_size!r}")
    reused = _reused_plan(model, world_size, mode, example_inputs) if analysis is None and enabled(reuse) else None
    if reused is not None:
        result, a = reused
    else:
        a = analysis or analyze_structure(model, example_inputs)
        result = auto_plan(a, world_size, mode)
    if overrides:
        over = overrides if isinstance(overrides, Plan) else Plan.from_dict(overrides)
        over.prefix = over.prefix or a.prefix
        over.resolve(a.leaves if reused is None else parameterised_leaves(model))  # naming no module raises
        result = result.updated(over)
    return result


def _reused_plan(model: nn.Module, world_size: int, mode: str, example_inputs: Any) -> tuple[Plan, Analysis] | None:
    """(the plan from the model's distinct blocks, the model cut to them), or None: no repeated blocks, or a
    fact the renaming cannot vouch for (then the whole model is traced)."""
    found = analyze_blocks(model, example_inputs)
    if found is None:
        return None
    short, blocks = found
    with shortened(model, blocks) as cut:
        small = auto_plan(dataclasses.replace(short, model=cut), world_size, mode)
        outside = outside_blocks((n for n, _ in cut.named_modules()), blocks)
    result = expand(small, blocks, outside)
    return None if result is None else (result, short)
