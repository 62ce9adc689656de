"""`tpkit.convert`: from an existing model to a tensor-parallel one.

`analyze` (which layers split, how, and memory per rank) -> `plan` (module -> style, as data) ->
`parallelize` (in place, this rank's shards) -> `verify` (run the plan on N thread-ranks and compare).
The estimates (`tpkit.estimate`) sit above and read these plans; this package never imports them.

The folder follows the conversion's steps (`parallelize.py` runs them in order):

    trace/          1. the model's dataflow, once (`Analysis`), and its repeated blocks
    planning/       2. the plan from the families' proposals (`planner`), repeated blocks' plans reused (`reuse`),
                       the dry run on meta tensors (`dryrun`, `head_reshapes`)
    layouts         3. which part of each tensor a rank holds (`ShardLayout`s), and `shard_layouts(model)`
    validate        4. what no single module can check alone
    swap, steps     5. build every new layer, then swap them in (`steps` runs 3 to 5 for the conversion and the dry
                       run alike)
    conversion         the record the conversion leaves on the model (`Conversion`)
    families/          the architecture patterns, each a `Family` in the one `registry`, with its `styles`
    plan, roles, family, registry, styles, modules, errors   the data and the vocabulary the steps share
    quantized          a model whose checkpoint stores its linear layers quantized
    peft/              PEFT's LoRA adapters: converted with their base layers, and the one seam to PEFT
    advice/            `analyze`: the report, its recommendations, the multi-node advice, the notices
    verify, wrapper    prove a plan on thread-ranks; the seed API's `DistributedModelWrapper`
    transformers_threads   transformers' names and builds from thread-ranks
"""
from __future__ import annotations

from .advice.analyze import AnalysisReport, LayerReport, analyze
from .conversion import Conversion, conversion_of
from .family import Checked, Choice, Draft, Family, Planned, Proposal
from .layouts import shard_layouts
from .advice.notices import quiet_conversions
from .parallelize import parallelize
from .plan import Plan, PlanError
from .planning.decide import plan
from .planning.planner import propose
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
