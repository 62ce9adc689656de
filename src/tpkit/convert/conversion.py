"""`Conversion`: the record of what `parallelize` did on one rank, kept on the converted model.

`model.tp_plan` is its plan; `tpkit.shard_layouts(model)` reads its layouts; checkpoints and `data_parallel`
read it through `conversions_in(model)` (a model wrapped after conversion holds it on a submodule).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from torch import nn

from ..layout import ShardLayout
from .family import Checked
from .plan import Plan
from .styles import SEQUENCE_PARALLEL

_ATTR = "_tp_conversion"


@dataclasses.dataclass(frozen=True)
class Conversion:
    """What `parallelize` did on one rank: the plan it applied and what each tensor now holds."""

    plan: Plan
    layouts: Mapping[str, ShardLayout]           # state_dict key -> layout (every key, replicated ones included)
    updated_attributes: Mapping[str, Mapping[str, Any]]  # module -> attributes set to local values (head counts)
    settled: Mapping[str, Checked]               # family name -> what its validation settled (the SP region)
    world_size: int
    rank: int

    @property
    def sequence_parallel(self) -> bool:
        """The residual stream is split along the sequence."""
        return SEQUENCE_PARALLEL in self.plan.entries.values()


def attach(model: nn.Module, conversion: Conversion) -> None:
    """Keep `conversion` on `model` and its plan as `model.tp_plan`."""
    setattr(model, _ATTR, conversion)
    # Hugging Face models expose `tp_plan` as a validating property backed by `_tp_plan`.
    if isinstance(getattr(type(model), "tp_plan", None), property):
        model._tp_plan = conversion.plan
    else:
        model.tp_plan = conversion.plan


def conversion_of(model: nn.Module) -> Conversion | None:
    """The conversion record `model` itself holds (None when it was not converted); its own attribute only, not one
    a wrapper forwards to the model it wraps (PEFT's `PeftModel` / `LoraModel` forward unknown attributes)."""
    return model.__dict__.get(_ATTR)


def conversions_in(model: nn.Module) -> list[tuple[str, Conversion]]:
    """(submodule name, record) of every converted module inside `model` (itself included)."""
    return [(n, c) for n, m in model.named_modules() if (c := conversion_of(m)) is not None]
