"""The record `find_pairs` fills while it walks the trace (the MLP and attention matchers write into it)."""
from __future__ import annotations

import dataclasses

from typing import Mapping

from torch import nn

from ..roles import Pair, Role
from .dataflow import Trace


@dataclasses.dataclass
class Pairing:
    """What `find_pairs` builds while it walks the trace: per module its role, the pairs, and why layers that
    look splittable are not part of a pair. Frozen into the `Analysis` when done. `modules`: the traced model's
    modules by name ("" the model itself), walked once by `trace_structure`."""

    modules: Mapping[str, nn.Module]
    leaves: dict[str, nn.Module]
    trace: Trace
    structures: dict[str, Role] = dataclasses.field(default_factory=dict)
    pairs: list[Pair] = dataclasses.field(default_factory=list)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)
