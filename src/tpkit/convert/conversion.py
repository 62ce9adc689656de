"""`Conversion`: the record of what `parallelize` did on one rank, kept on the converted model.

It is the model's record (`tpkit.nn.record.ModelRecord`: the communicator, every state-dict key's layout, the
data-parallel facts once `data_parallel` adds them) plus what only the converter knows: the plan it applied, the
attributes it set to local values, what each family's validation settled. `model.tp_plan` is its plan;
`tpkit.shard_layouts(model)` reads its layouts; checkpoints, `clip_grad_norm_`, the replica sentinel and
`data_parallel` read it through `tpkit.nn.record` (a model wrapped after conversion holds it on a submodule).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from torch import nn

from ..nn.record import ModelRecord, attach_record, record_of
from .family import Checked
from .plan import Plan
from .styles import SEQUENCE_PARALLEL


@dataclasses.dataclass(eq=False)
class Conversion(ModelRecord):
    """What `parallelize` did on one rank: the plan it applied and what each tensor now holds."""

    plan: Plan = dataclasses.field(kw_only=True)
    updated_attributes: Mapping[str, Mapping[str, Any]] = dataclasses.field(kw_only=True)  # module -> attributes
    #                                                                       set to local values (head counts)
    settled: Mapping[str, Checked] = dataclasses.field(kw_only=True)  # family name -> what its validation settled

    @property
    def sequence_parallel(self) -> bool:
        """The residual stream is split along the sequence."""
        return SEQUENCE_PARALLEL in self.plan.entries.values()


def attach(model: nn.Module, conversion: Conversion) -> None:
    """Keep `conversion` on `model` as its record, and its plan as `model.tp_plan`."""
    attach_record(model, conversion)
    # Hugging Face models expose `tp_plan` as a validating property backed by `_tp_plan`.
    if isinstance(getattr(type(model), "tp_plan", None), property):
        model._tp_plan = conversion.plan
    else:
        model.tp_plan = conversion.plan


def conversion_of(model: nn.Module) -> Conversion | None:
    """The conversion record `model` itself holds (None when it was not converted); its own attribute only, not one
    a wrapper forwards to the model it wraps (PEFT's `PeftModel` / `LoraModel` forward unknown attributes)."""
    record = record_of(model)
    return record if isinstance(record, Conversion) else None


def conversions_in(model: nn.Module) -> list[tuple[str, Conversion]]:
    """(submodule name, record) of every converted module inside `model` (itself included)."""
    return [(n, c) for n, m in model.named_modules() if (c := conversion_of(m)) is not None]
