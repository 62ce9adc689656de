"""Parameters an attention module holds itself, beside its projections: how each one meets the heads.

Attention sinks (one logit per head), per-head gate biases, DeBERTa's q/v biases (one vector per head, added after
the projection) and DiffLlama's lambdas (one vector of head_dim, reduced to a scalar every head uses) are no
layer's parameters, so nothing splits them with the heads by itself. The trace keeps every op where such a
parameter meets the block's heads (`dataflow.Meeting`); from those alone each one is:
- "heads" (one entry per query head) or "head_features" (heads x head_dim, head-major): every meeting is a view
  of the parameter whose only varying axis of the head count steps one head at a time (strides 1, or head_dim
  with the head_dim axis last), lined up (elementwise broadcast or a join along another axis) with the one axis
  of the head count of a tensor laid out by heads. Each rank then holds its heads' slice;
- "shared": every meeting is a scalar, or a vector of head_dim broadcast along the last axis of a tensor laid out
  by heads: every head uses it the same way, so each rank holds it whole (its gradient summed over the ranks);
- anything else, or a parameter that also reaches a layer's input, is unproven and the block stays whole.
A block whose heads are cut or joined along the head axis (DiffLlama combines head h with head h + heads/2) is
no split by contiguous heads either: it stays whole when it holds such parameters.
"""
from __future__ import annotations

import math

from torch import nn

from .dataflow import Trace
from .loose import Meeting
from .ops import ELEMENTWISE, JOINS

HEADS, HEAD_FEATURES, SHARED = "heads", "head_features", "shared"


def _per_head(m: Meeting, p: nn.Parameter, nh: int, hd: int) -> str | None:
    """HEADS / HEAD_FEATURES when this meeting lines the parameter's heads up with the heads it meets."""
    unit = 1 if p.numel() == nh else hd if p.numel() == nh * hd else None
    if unit is None or m.view is None or m.view[1] != 0 or nh < 2:
        return None
    strides, shape = m.view[0], m.shape
    live = [i for i, (s, st) in enumerate(zip(shape, strides)) if s > 1 and st != 0]
    if unit == 1:
        if len(live) != 1:
            return None
        a = live[0]
    else:
        last = len(shape) - 1
        if len(live) != 2 or live[1] != last or shape[last] != hd or strides[last] != 1 or m.other_shape[-1] != hd:
            return None
        a = live[0]
    if shape[a] != nh or strides[a] != unit:
        return None
    other = m.other_shape
    x = len(other) - (len(shape) - a)
    if x <= 0 or x == len(other) - 1 or other[x] != nh or (m.dim is not None and m.dim % len(shape) == a):
        return None
    if any(other[i] == nh for i in range(len(other) - 1) if i != x):
        return None  # another axis of the head count: which one holds the heads is not proven
    return HEADS if unit == 1 else HEAD_FEATURES


def _kind(m: Meeting, p: nn.Parameter, nh: int, hd: int) -> str | None:
    if m.op not in ELEMENTWISE and m.op not in JOINS:
        return None
    if math.prod(m.shape) == 1 and m.op not in JOINS:
        return SHARED
    if (m.op not in JOINS and m.shape and m.shape[-1] == hd and all(s == 1 for s in m.shape[:-1])
            and m.other_shape and m.other_shape[-1] == hd and hd in m.other.reshaped_to):
        return SHARED
    return _per_head(m, p, nh, hd) if len(m.names) == 1 else None


def head_params(t: Trace, params: dict[str, nn.Parameter], block: set, attn: str, nh: int, hd: int,
                nkv: int, cut: frozenset) -> tuple[dict[str, str], str | None]:
    """`({parameter: kind}, None)` when every one of `params` (qualified name -> parameter) is proven to follow the
    heads of the block made of `block` (its layers), else `({}, why it stays whole)`."""
    if params and (nh in cut or nkv in cut):
        return {}, (f"{attn} holds {sorted(params)} itself, and its heads are cut or joined along an axis of the "
                    f"head count ({nh} heads, {nkv} KV heads) on the way to its output layer (heads combined with "
                    f"each other), so a split by contiguous heads is not proven; the attention stays whole")
    kinds: dict[str, str] = {}
    for name, p in params.items():
        meets = [m for m in t.meetings if name in m.names]
        outside = sorted({s for m in meets for s in m.other.sources} - block)
        if name in t.fed or not meets or outside:
            where = (f"reaches a layer's input or the model's output" if name in t.fed else f"meets {outside}, outside the block"
                     if outside else "never meets its heads in the trace")
            return {}, _whole(attn, name, where)
        found = {_kind(m, p, nh, hd) for m in meets}
        if None in found or len(found) > 1:
            bad = next((m for m in meets if _kind(m, p, nh, hd) is None), meets[0])
            return {}, _whole(attn, name, f"meets its heads as {list(bad.shape)} against {list(bad.other_shape)} "
                                          f"in `{bad.op}`, which the planner cannot line up with {nh} heads of {hd} "
                                          f"(one entry per head, heads x head_dim, or one value / one head_dim "
                                          f"vector for every head)")
        kinds[name] = found.pop()
    return kinds, None


def _whole(attn: str, name: str, where: str) -> str:
    return (f"{attn} holds {name} itself, which {where}; it cannot be proven to follow the heads (per-head "
            f"scales?), so the attention stays whole")
