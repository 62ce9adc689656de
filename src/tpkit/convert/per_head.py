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

from ..nn.layout import Piece, ShardLayout
from .errors import PlanError
from .heads import HeadLayoutError, head_layout
from .modules import is_embedding, kind

PER_HEAD = "per_head"


def head_columns(details: Mapping, world: int) -> Piece:
    """Each rank's span of a one-column-per-query-head tensor, from the attention's head counts."""
    try:
        lay = head_layout(details["num_heads"], details["num_kv_heads"], world, details.get("attention") or "")
    except HeadLayoutError as exc:
        raise PlanError(f"{exc}; mark this attention block 'replicate' instead") from None
    spans = tuple((h[0], h[-1] + 1) if h else (0, 0) for h in lay.q_heads)
    return Piece(0, lay.num_heads, spans)


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
        return {"weight": ShardLayout(tuple(m.weight.shape), world, rank, 1, (head_columns(details, world),))}

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
        return new


def is_per_head_source(m: nn.Module, num_heads: int) -> bool:
    """A layer that can be split with the heads: an embedding with one column per head."""
    return is_embedding(m) and m.embedding_dim == num_heads and isinstance(m.weight, torch.Tensor)
