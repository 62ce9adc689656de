"""What one rank holds of a transformer's widths at TP t: query and KV heads as `parallelize` lays them out
(`tpkit.layout.heads`), the MLP width and the vocabulary as `tpkit.comm.split_sizes` cuts them.

Every per-rank figure (parameters, activations, KV cache) goes through here, so the estimate and the converter
cannot disagree on which rank holds an extra head when a size does not divide.
"""
from __future__ import annotations

import functools

from ..layout import HeadLayoutError, head_layout, split_sizes
from .config import TransformerShape


@functools.lru_cache(maxsize=256)
def _head_layout(num_heads: int, num_kv_heads: int, world_size: int) -> tuple[tuple[int, ...], ...] | None:
    """(query heads, KV heads, KV-cache heads) per rank as `parallelize` lays them out for a Hugging Face
    attention (which can expand its KV heads, so query heads are spread evenly), or None (no layout)."""
    try:
        layout = head_layout(num_heads, num_kv_heads, world_size, spread=num_kv_heads < num_heads)
    except HeadLayoutError:
        return None
    return (tuple(len(q) for q in layout.q_heads), tuple(len(k) for k in layout.kv_heads),
            tuple(layout.cache_heads(r) for r in range(world_size)))


def rank_heads(num_heads: int, num_kv_heads: int, world_size: int, rank: int = 0) -> tuple[int, int, bool]:
    """(query heads, KV heads, split?) on `rank`, as `parallelize` lays them out.

    The layout is the converter's (`tpkit.layout.heads.head_layout`: whole heads, query heads as even as
    possible, each rank holding (replicated where shared) the KV heads its query heads read; a later rank may
    hold more KV heads than rank 0). When no layout exists the attention stays replicated.
    """
    if world_size == 1:
        return num_heads, num_kv_heads, True
    layout = _head_layout(num_heads, num_kv_heads, world_size)
    if layout is None:
        return num_heads, num_kv_heads, False
    return layout[0][rank], layout[1][rank], True


def rank_cache_heads(num_heads: int, num_kv_heads: int, world_size: int, rank: int = 0) -> int:
    """KV heads `rank`'s attention caches: its KV heads, or one per query head on a rank whose KV heads serve
    unequal numbers of its query heads (they are expanded; `tpkit.layout.heads`)."""
    layout = _head_layout(num_heads, num_kv_heads, world_size) if world_size > 1 else None
    return num_kv_heads if layout is None else layout[2][rank]


def rank_widths(shape: TransformerShape, t: int, rank: int) -> tuple[int, int, int, int]:
    """(query heads, KV heads, MLP width, vocabulary rows) that `rank` holds."""
    q_heads, kv_heads, _ = rank_heads(shape.num_heads, shape.num_kv_heads, t, rank)
    return q_heads, kv_heads, split_sizes(shape.intermediate_size, t)[rank], split_sizes(shape.vocab_size, t)[rank]
