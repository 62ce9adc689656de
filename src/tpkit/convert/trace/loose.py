"""Parameters no layer owns, followed through the traced forward beside the tags (`dataflow.py`).

An attention module's own sinks, per-head biases or scalars are "loose": the tracer carries no tag for them, so
this keeps, for every tensor made from loose parameters alone, which ones it is made of and (while views and
elementwise ops of one parameter alone keep it known) which element of the parameter each of its elements is.
Every op where such a tensor meets a tagged one is kept as a `Meeting`; loose values that reach a layer's input
or leave the model untagged are `fed`. The planner reads them to prove how a parameter lines up with the heads
(`head_params.py`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .flat import flatten
from .ops import ELEMENTWISE, JOINS


@dataclasses.dataclass(frozen=True)
class Meeting:
    """One op where a tensor made from loose parameters (`names`, none of them a layer's) met a tagged tensor:
    its shape, `view`: `(strides, offset)` when it is made of one contiguous parameter by views and elementwise
    ops alone, element [i, j, ...] being the parameter's flat element offset + i * strides[0] + ... (else None), the
    tagged operand's shape and tag; `dim` is the axis a join (`cat`) put them together along."""

    names: frozenset
    op: str
    shape: tuple
    view: tuple | None
    other_shape: tuple
    other: Any  # the tagged operand's `dataflow.Tag`
    dim: int | None = None


class LooseParams:
    """The loose parameters of one traced forward and what was made of them."""

    def __init__(self, params: dict | None = None):
        self.params: dict[int, tuple[torch.Tensor, str]] = params or {}  # id(parameter) -> (it, its name)
        self.derived: dict[int, tuple[torch.Tensor, frozenset]] = {}  # tensors made from loose ones only
        self.maps: dict[int, tuple[torch.Tensor, tuple]] = {}  # elementwise results of one parameter: see _map
        self.meetings: list[Meeting] = []
        self.fed: set = set()

    def names(self, t: Any) -> frozenset | None:
        """The loose parameters `t` is made of (None: it is no loose parameter nor made from them alone)."""
        if not isinstance(t, torch.Tensor):
            return None
        entry = self.params.get(id(t))
        if entry is not None and entry[0] is t:
            return frozenset((entry[1],))
        entry = self.derived.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else None

    def feed(self, tensors) -> None:
        """`tensors` reach a layer's input or the model's output: loose values among them go untagged."""
        for t in tensors:
            self.fed |= self.names(t) or frozenset()

    def follow(self, name: str, loose: list, flat: list, out: Any) -> None:
        """An op of loose tensors (`loose`: (tensor, names)) and no tagged one: its outputs are made of them."""
        names = frozenset().union(*(n for _, n in loose))
        for t in flatten(out):
            if isinstance(t, torch.Tensor):
                self.derived[id(t)] = (t, names)
        (a, one), = loose if len(loose) == 1 else ((None, None),)
        if a is None or len(one) != 1 or name not in ELEMENTWISE or not isinstance(out, torch.Tensor) \
                or out.shape != a.shape or any(isinstance(x, torch.Tensor) and x is not a and x.numel() > 1
                                               for x in flat):
            return  # only an elementwise op of one parameter (and scalars) keeps each element where it was
        m = self._map(a)
        if m is not None:
            self.maps[id(out)] = (out, m)

    def meet(self, name: str, loose: list, tagged: list, args, kwargs) -> None:
        """Keep a `Meeting` for each loose operand of an op that also takes a tagged tensor."""
        other, tag = next((a, tg) for a, tg in tagged if tg is not None)
        dim = None
        if name in JOINS:
            d = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            dim = d if isinstance(d, int) else None
        for a, names in loose:
            view = self._map(a) if len(names) == 1 else None
            self.meetings.append(Meeting(names, name, tuple(a.shape), view, tuple(other.shape), tag, dim))

    def _map(self, t: torch.Tensor) -> tuple | None:
        """`(strides, offset)` placing each element of `t` in its one loose parameter (see `Meeting.view`)."""
        entry = self.maps.get(id(t))
        if entry is not None and entry[0] is t:
            return entry[1]
        p = self.params.get(id(t))
        if p is not None and p[0] is t:
            return (tuple(t.stride()), 0) if t.is_contiguous() else None
        base = getattr(t, "_base", None)
        if base is None or not base.is_contiguous() or self._map(base) != (tuple(base.stride()), 0):
            return None  # a view of something not laid out as its parameter
        return tuple(t.stride()), int(t.storage_offset() - base.storage_offset())
