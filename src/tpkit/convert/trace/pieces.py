"""Packed projections in the dataflow trace (`dataflow.py`): one layer's clean output cut into pieces along its
features, as a split by pieces would cut them, so the planner can split each piece on its own (q | k | v, gate |
up). The trace sees three ways of cutting: a split or chunk of the last axis (GPT-2's `split`), slices
`x[..., a:b]` that tile the features (Phi-3's qkv), and rows `x[..., i, :]` of a view as [k, width / k] (Moshi's
gated MLP). A layer whose slices do not tile its output is `broken`.
"""
from __future__ import annotations

from typing import Any

import torch

from .flat import flatten


class Pieces:
    """The pieces found so far, fed by the tracer op by op; `result` when the trace ends."""

    def __init__(self):
        self.found: dict[str, tuple] = {}  # layer -> the widths of its pieces, in order
        self.slices: dict[str, set] = {}  # layer -> the (start, stop) spans sliced from its output
        # id of a clean output viewed as [k, width / k] -> (it, its tag before the view)
        self.stacked: dict[int, tuple[torch.Tensor, Any]] = {}

    def split(self, ref, out, fdim: int, tag) -> bool:
        """A split of a single layer's clean output along its features marks a packed projection."""
        parts = [t for t in flatten(out) if isinstance(t, torch.Tensor)]
        if not parts or len(tag.sources) != 1 or not tag.clean:
            return False
        if any(p.dim() != ref.dim() for p in parts) or sum(p.shape[fdim] for p in parts) != ref.shape[fdim]:
            return False
        (src,) = tag.sources
        self.found[src] = tuple(int(p.shape[fdim]) for p in parts)
        return True

    def slice(self, key, ref, out, fdim: int, tag) -> bool:
        """`x[..., a:b]` of one layer's clean output: a piece of a packed projection, kept if the pieces taken
        from it tile its features exactly (checked by `result`)."""
        if len(tag.sources) != 1 or not tag.clean or not isinstance(out, torch.Tensor) or fdim != ref.dim() - 1:
            return False
        if key is None:
            return False
        parts = key if isinstance(key, tuple) else (key,)
        if not parts or not isinstance(parts[-1], slice) or parts[-1].step not in (None, 1):
            return False
        lead = parts[:-1]
        if not (lead == (Ellipsis,) or (len(lead) == ref.dim() - 1 and all(p == slice(None) for p in lead))):
            return False
        start, stop, _ = parts[-1].indices(ref.shape[-1])
        (src,) = tag.sources
        self.slices.setdefault(src, set()).add((start, stop))
        return True

    def note_stacked(self, ref, out, tag, fdim: int) -> None:
        """A clean output of one layer viewed as [k, width / k] (Moshi: `view(b, s, 2, -1)`): its pieces may be
        the rows of that view (`stacked_piece`)."""
        if len(tag.sources) == 1 and tag.clean and fdim == ref.dim() - 1 and out.dim() == ref.dim() + 1 \
                and out.shape[:-2] == ref.shape[:-1]:
            self.stacked[id(out)] = (out, tag)

    def stacked_piece(self, key, ref, out):
        """`x[..., i, :]` of a stacked view: piece i of the layer's features, in order, as a split would give it.
        Its tag (the one before the view), or None when this is no such row."""
        entry = self.stacked.get(id(ref))
        if entry is None or entry[0] is not ref or not isinstance(out, torch.Tensor):
            return None
        key = axes(key, ref.dim())
        if key is None or not isinstance(key[-2], int) or any(k != slice(None) for k in key[:-2] + key[-1:]):
            return None
        (src,) = entry[1].sources
        k, width = int(ref.shape[-2]), int(ref.shape[-1])
        if self.found.setdefault(src, (width,) * k) != (width,) * k:
            return None
        return entry[1]

    def result(self, calls: dict) -> tuple[dict, set]:
        """(layer -> its pieces, the layers whose slices do not tile their output): a layer's slices are its
        pieces when they tile its output exactly."""
        pieces = dict(self.found)
        broken: set = set()
        for src, spans in self.slices.items():
            spans = sorted(spans)
            width = calls[src][0].output_shape[-1] if calls.get(src) and calls[src][0].output_shape else None
            tiles = spans[0][0] == 0 and spans[-1][1] == width and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            if tiles and src not in pieces:
                pieces[src] = tuple(b - a for a, b in spans)
            else:
                broken.add(src)
        return pieces, broken


def axes(key: Any, dims: int) -> tuple | None:
    """An indexing key as one entry per axis of a `dims`-axis tensor (Ellipsis expanded), or None when it is not
    plain ints and slices."""
    if key is None:
        return None
    parts = key if isinstance(key, tuple) else (key,)
    if any(p is None or not isinstance(p, (int, slice, type(Ellipsis))) or isinstance(p, bool) for p in parts):
        return None
    if parts.count(Ellipsis) > 1:
        return None
    if Ellipsis in parts:
        at = parts.index(Ellipsis)
        parts = parts[:at] + (slice(None),) * (dims - len(parts) + 1) + parts[at + 1:]
    parts = parts + (slice(None),) * (dims - len(parts))
    return parts if len(parts) == dims else None
