"""`tpkit.convert`: from an existing model to a tensor-parallel one, and the figures to decide with.

`analyze` (which layers split, how, and memory per rank) -> `plan` (module -> style, as data) ->
`parallelize` (in place, this rank's shards) -> `verify` (run the plan on N thread-ranks and compare);
`estimate_memory` / `estimate_speed` give the numbers before any hardware is at hand.
"""
from __future__ import annotations

from .analyze import AnalysisReport, LayerReport, analyze
from .layouts import shard_layouts
from .parallelize import parallelize
from .plan import STYLES, Plan, PlanError
from .planner import plan
from .verify import VerifyReport, verify
from .wrapper import DistributedModelWrapper

_ESTIMATOR = {"estimate_memory": ".estimate", "MemoryEstimate": ".estimate", "estimate_speed": ".speed"}


def __getattr__(name: str):
    # The estimator's modules are imported on first use (they may pull in presets and hardware tables).
    if name in _ESTIMATOR:
        import importlib

        return getattr(importlib.import_module(_ESTIMATOR[name], __name__), name)
    raise AttributeError(f"module 'tpkit.convert' has no attribute {name!r}")


__all__ = [
    "AnalysisReport", "DistributedModelWrapper", "LayerReport", "MemoryEstimate", "Plan", "PlanError", "STYLES",
    "VerifyReport", "analyze", "estimate_memory", "estimate_speed", "parallelize", "plan", "shard_layouts", "verify",
]
