"""`tpkit.convert`: from an existing model to a tensor-parallel one.

`analyze` (which layers split, how, and memory per rank) -> `plan` (module -> style, as data) ->
`parallelize` (in place, this rank's shards) -> `verify` (run the plan on N thread-ranks and compare).
The estimates (`tpkit.estimate`) sit above and read these plans; this package never imports them.
"""
from __future__ import annotations

from .analyze import AnalysisReport, LayerReport, analyze
from .conversion import Conversion, conversion_of
from .family import Checked, Choice, Draft, Family, Planned, Proposal
from .layouts import shard_layouts
from .notices import quiet_conversions
from .parallelize import parallelize
from .plan import Plan, PlanError
from .planner import plan, propose
from .registry import FAMILIES, STYLES, register_family, unregister_family
from .roles import Role
from .styles import Style
from .verify import VerifyReport, verify
from .wrapper import DistributedModelWrapper

__all__ = [
    "AnalysisReport", "Checked", "Choice", "Conversion", "DistributedModelWrapper", "Draft", "FAMILIES", "Family",
    "LayerReport", "Plan", "PlanError", "Planned", "Proposal", "Role", "STYLES", "Style", "VerifyReport", "analyze",
    "conversion_of", "parallelize", "plan", "propose", "quiet_conversions", "register_family", "shard_layouts",
    "unregister_family", "verify",
]
