"""Step 2 of conversion (plan): from a structure `Analysis` to a `Plan` for a world size.

Every registered family (`registry.FAMILIES`, in order) proposes entries for the groups of modules it owns, each
with its alternatives; the chosen alternative (the default unless `choose` names another) is applied before the
next proposal is asked for. Every layer no family split stays replicated, with the reason.
"""
from __future__ import annotations

from typing import Mapping

from ..family import Draft, Proposal
from ..plan import Plan
from ..registry import STYLES, families
from ..styles import REPLICATE
from ..trace import Analysis

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
