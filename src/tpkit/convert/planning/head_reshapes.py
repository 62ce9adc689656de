"""Reshapes to heads keep their last size when the heads are split: a check the dry run makes.

A split by heads gives each rank whole heads, so every reshape that cuts an attention block's features into heads
(`view(b, s, heads, head_dim)`, `view(b, s, heads, 3 * head_dim)`) should run on every rank with the same last
size as in the whole model; only the head count, and widths made of whole heads, shrink. A forward that computes
that size from a width the conversion made local, divided by a constant (CodeGen: `embed_dim // 4` with its
`mp_num = 4` written into the forward), runs without an error on the converted model and reads the wrong
features: the trace cannot see it (the constant happens to equal the head count), and no shape breaks. So the
dry run records, inside each split attention module, the last size of every reshape that adds an axis, once
for the whole model and once per converted rank, and a size that changed (other than a width of whole heads)
keeps that block whole.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

from torch import nn
from torch.overrides import TorchFunctionMode

from ..roles import ATTENTION, Pair
from ..trace.heads import cut_size
from ..trace.state import popping


class HeadReshapes(TorchFunctionMode):
    """Records, per watched module (the innermost running one), the last size of each reshape that adds an axis
    (a cut of the features; one head per rank cuts into one). Use as a context manager around one forward."""

    def __init__(self, model: nn.Module, watched: Iterable[str]):
        super().__init__()
        self.seen: dict[str, list[int]] = {}
        self._stack: list[str] = []
        self._handles = []
        modules = dict(model.named_modules())
        for name in watched:
            if name in modules:
                self.seen[name] = []
                self._handles.append(modules[name].register_forward_pre_hook(
                    lambda *_, n=name: self._stack.append(n)))
                self._handles.append(modules[name].register_forward_hook(popping(self._stack), always_call=True))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._stack and (size := cut_size(func, args, out)) is not None:
            self.seen[self._stack[-1]].append(size)
        return out

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return super().__exit__(*exc)


def from_trace(cuts: Iterable[tuple[tuple[str, ...], int]], watched: Iterable[str]) -> dict[str, list[int]]:
    """What `HeadReshapes` over `watched` would record in the forward that recorded `cuts` (the trace's
    `head_cuts`: the modules running at each reshape that added an axis, and its last size)."""
    seen: dict[str, list[int]] = {name: [] for name in watched}
    for running, size in cuts:
        owner = next((n for n in reversed(running) if n in seen), None)
        if owner is not None:
            seen[owner].append(size)
    return seen


def watched(pairs: Iterable[Pair], split: set[str]) -> dict[str, Pair]:
    """The attention modules of the pairs whose output layer the plan splits."""
    return {p.attention: p for p in pairs if p.kind == ATTENTION and p.attention and p.row in split}


def changed(whole: dict[str, list[int]], local: dict[str, list[int]], pairs: dict[str, Pair]) -> tuple | None:
    """(attention module, why) for the first block whose reshapes to heads changed their last size, or None.
    Sizes made of whole heads (multiples of the query or key/value width) may shrink; nothing else may."""
    for name, pair in pairs.items():
        widths = {w for w in (pair.num_heads * pair.head_dim, (pair.num_kv_heads or 0) * pair.head_dim) if w}

        def kept(sizes: list[int]) -> Counter:
            return Counter(s for s in sizes if not any(s % w == 0 for w in widths))
        was, now = kept(whole.get(name, [])), kept(local.get(name, []))
        if was != now:
            return name, (f"its forward cuts the features into heads of {sorted(was.elements())} in the whole model "
                          f"but {sorted(now.elements())} once split (a head size computed from a width and a "
                          f"constant); split, it would read the wrong features")
    return None
