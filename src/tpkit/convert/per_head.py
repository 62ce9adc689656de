"""Per-head tensors that are not projections: split with the heads they belong to.

T5 adds to its attention scores a learned bias read from an embedding with one column per head
(`relative_attention_bias`, [buckets, heads]). The dataflow (`pairs.py`) finds it as a source of an attention
block's scores whose width is that block's head count; when the block's heads are split, each rank needs only
the columns of its own heads, and the scores it adds them to are already its heads only. So the embedding
keeps this rank's head columns and no communication is needed: its output stays split, like a column-wise
layer's. One such tensor may serve several blocks (T5 computes the bias in the first block and hands it to the
others); the planner splits it only when every block it reaches is split with the same heads.

`PerHead` is a plan style (registered in `styles.STYLES` as "per_head"), written against the same small
interface as the classes in `styles.py` (check / layouts / build).
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from ..layout import Piece, ShardLayout
from .errors import PlanError
from ..layout import HeadLayoutError, head_columns, head_layout
from .modules import is_embedding, keep_output_scale, kind

PER_HEAD = "per_head"


def head_piece(details: Mapping, world: int) -> Piece:
    """Each rank's span of a one-column-per-query-head tensor, from the attention's head counts."""
    try:
        lay = head_layout(details["num_heads"], details["num_kv_heads"], world, details.get("attention") or "")
    except HeadLayoutError as exc:
        raise PlanError(f"{exc}; mark this attention block 'replicate' instead") from None
    return head_columns(lay)


class PerHead:
    """An embedding with one column per attention head, holding this rank's heads' columns (output stays split)."""

    name = PER_HEAD
    description = ("per-head tensor (T5's relative attention bias: an embedding with one column per head): holds "
                   "this rank's heads' columns, output stays split with the heads")
    collectives: tuple[str, ...] = ()
    container = False

    def check(self, name: str, m: nn.Module, details: Mapping, world: int) -> None:
        where = f"{name} ({kind(m)})"
        if not is_embedding(m):
            raise PlanError(f"{where}: style 'per_head' needs an nn.Embedding with one column per head")
        if "num_heads" not in details:
            raise PlanError(f"{where}: style 'per_head' needs the attention heads it belongs to; the planner finds "
                            f"them in the dataflow (use plan='auto' or copy its details)")
        if m.embedding_dim != details["num_heads"]:
            raise PlanError(f"{where}: {m.embedding_dim} columns, but its attention has {details['num_heads']} heads")

    def layouts(self, m: nn.Module, details: Mapping, world: int, rank: int) -> dict[str, ShardLayout]:
        return {"weight": ShardLayout(tuple(m.weight.shape), world, rank, 1, (head_piece(details, world),))}

    def build(self, m: nn.Module, layouts: Mapping[str, ShardLayout], comm,
              sequence_parallel: bool = False) -> nn.Module:
        from ..nn import mark_tensor_parallel

        lay = layouts["weight"]
        new = nn.Embedding(m.num_embeddings, lay.local_shape[1], padding_idx=m.padding_idx, max_norm=m.max_norm,
                           norm_type=m.norm_type, scale_grad_by_freq=m.scale_grad_by_freq, sparse=m.sparse,
                           device="meta")
        w = nn.Parameter(lay.shard(m.weight.detach()).clone(), requires_grad=m.weight.requires_grad)
        new.weight = mark_tensor_parallel(w, 1, lay.sizes())
        new.train(m.training)
        return keep_output_scale(m, new)


def head_args(plain_args: Mapping, batch: int, num_heads: int) -> dict:
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


def _slice_heads(x, layout: str, num_heads: int, first: int, count: int):
    if layout == "flat":
        return x.unflatten(0, (-1, num_heads)).narrow(1, first, count).flatten(0, 1)
    return x.narrow(1, first, count)


def install_head_arg_slicers(attn: nn.Module, args: Mapping, num_heads: int, heads: tuple) -> None:
    """Give `attn` only this rank's heads of its per-head arguments (a forward pre-hook; `heads` are the rank's
    query heads, contiguous)."""
    first, count = heads[0], len(heads)
    args = {(int(k) if isinstance(k, str) and k.isdigit() else k): v for k, v in args.items()}  # JSON: keys str

    def hook(mod, a, kw):
        a = tuple(_slice_heads(v, args[i], num_heads, first, count) if i in args and v is not None else v
                  for i, v in enumerate(a))
        kw = {k: _slice_heads(v, args[k], num_heads, first, count) if k in args and v is not None else v
              for k, v in kw.items()}
        return a, kw

    attn.register_forward_pre_hook(hook, with_kwargs=True)


def is_per_head_source(m: nn.Module, num_heads: int) -> bool:
    """A layer that can be split with the heads: an embedding with one column per head."""
    return is_embedding(m) and m.embedding_dim == num_heads and isinstance(m.weight, torch.Tensor)
