"""`tpkit.convert`: from an existing model to a tensor-parallel one.

`analyze` (which layers split, how, and memory per rank) -> `plan` (module -> style, as data) ->
`parallelize` (in place, this rank's shards) -> `verify` (run the plan on N thread-ranks and compare).
The estimates (`tpkit.estimate`) sit above and read these plans; this package never imports them.

The folder follows the conversion's steps (`parallelize.py` runs them in order, over one `state.ConversionState`):

    state           the request read once, the state the steps hand each other, the rule that each runs once
    peft/           0., 10. PEFT's LoRA adapters taken out and put back round the new base layers; the seam to PEFT
    trace/          1. the model's dataflow (`Analysis`), or its cut to distinct blocks'
    planning/       1.-5. (`decide`): the plan from the families' proposals (`planner`), the dry run on a copy
                       (`dryrun`, `head_reshapes`), a cut's plan given to every block (`reuse`)
    steps           6.-9. quantization units, lay out, build and swap, record (and what the dry run shares)
    layouts         7. which part of each tensor a rank holds (`ShardLayout`s), `shard_layouts(model)`; 11.
    validate        4., 7. what no single module can check alone
    swap            8. build every new layer, then swap them in
    conversion         the record the conversion leaves on the model (`Conversion`)
    families/          the architecture patterns, each a `Family` in the one `registry`, with its `styles`
    plan, roles, family, registry, styles, modules, errors   the data and the vocabulary the steps share
    quantized          a model whose checkpoint stores its linear layers quantized
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
