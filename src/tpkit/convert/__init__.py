"""`tpkit.convert`: from an existing model to a tensor-parallel one.

`analyze` (which layers split, how, and memory per rank) -> `plan` (module -> style, as data) ->
`parallelize` (in place, this rank's shards) -> `verify` (run the plan on N thread-ranks and compare).
The estimates (`tpkit.estimate`) sit above and read these plans; this package never imports them.
"""
from __future__ import annotations

from .analyze import AnalysisReport, LayerReport, analyze
from .layouts import shard_layouts
from .parallelize import parallelize
from .plan import STYLES, Plan, PlanError
from .planner import plan
from .verify import VerifyReport, verify
from .wrapper import DistributedModelWrapper

__all__ = [
    "AnalysisReport", "DistributedModelWrapper", "LayerReport", "Plan", "PlanError", "STYLES",
    "VerifyReport", "analyze", "parallelize", "plan", "shard_layouts", "verify",
]
