"""What an attention module says of its heads, as the trace reads it: head size and counts from its attributes
(or its config), and the arguments it takes with one slice per head (ALiBi biases built for all heads).

The attribute names are shared with the attention family, which sets the local counts after a split.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "d_head", "d_k")
NUM_HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_attention_heads_per_partition")
NUM_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
_CUT_OPS = frozenset(("view", "reshape", "unflatten"))


def cut_size(func, args, out) -> int | None:
    """The last size of a reshape that adds an axis (features cut into heads; one head per rank cuts into one),
    else None. The trace records it per running module for the whole model, the dry run per converted rank, and
    `planning/head_reshapes.py` compares the two."""
    if getattr(func, "__name__", "") in _CUT_OPS and args and isinstance(args[0], torch.Tensor) \
            and isinstance(out, torch.Tensor) and out.dim() > args[0].dim() > 0:
        return int(out.shape[-1])
    return None


def _int_attr(m: Any, names) -> int | None:
    for n in names:
        v = getattr(m, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def head_info(attn: nn.Module) -> tuple[int | None, int | None, int | None]:
    """(head_dim, num_heads, num_kv_heads) as the attention module (or its config) states them."""
    cfg = getattr(attn, "config", None)
    hd = _int_attr(attn, HEAD_DIM_ATTRS)
    nh = _int_attr(attn, NUM_HEADS_ATTRS)
    nkv = _int_attr(attn, NUM_KV_ATTRS)
    if cfg is not None:
        hd = hd or _int_attr(cfg, ("head_dim",))
        nh = nh or _int_attr(cfg, ("num_attention_heads", "n_head"))
        nkv = nkv or _int_attr(cfg, ("num_key_value_heads",))
    groups = _int_attr(attn, ("num_key_value_groups",))
    if nkv is None and nh and groups:
        nkv = nh // groups
    return hd, nh, nkv


def head_args(plain_args: Mapping, batch: int, num_heads: int) -> dict[int | str, str]:
    """Arguments of an attention module that hold one slice per head and come from outside the split layers
    (BLOOM's ALiBi bias, built by the model for all heads): `{position or keyword: "flat"}` for
    [batch x heads, q or 1, k] and `"dim1"` for [batch, heads, q or 1, k] (floating point, never the input
    the projections read)."""
    out = {}
    for at, shape in plain_args.items():
        if num_heads < 2:
            continue
        if len(shape) == 3 and shape[0] == batch * num_heads:
            out[at] = "flat"
        elif len(shape) == 4 and shape[0] == batch and shape[1] == num_heads:
            out[at] = "dim1"
    return out
