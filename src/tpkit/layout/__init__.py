"""`tpkit.layout`: which part of which tensor a rank holds, as values that know only shapes.

The bottom of the house: the split rule (`split_sizes`, `split_range`: how a size that does not divide is
cut), `ShardLayout` / `Piece` (one full tensor, one rank's part of it), and head layouts (whole attention heads
per rank with the KV heads they read, and the pieces they make of a projection). comm, nn, convert, checkpoint, estimate and
data_parallel all read shards from here, so every shard in tpkit is cut by the same rule.
"""
from __future__ import annotations

from .heads import (HeadLayout, HeadLayoutError, group_pieces, head_columns, head_layout, head_spans,
                    heads_of, valid_world_sizes)
from .shard import Piece, ShardLayout
from .split import split_range, split_sizes

__all__ = ["HeadLayout", "HeadLayoutError", "Piece", "ShardLayout", "group_pieces", "head_columns", "head_layout",
           "head_spans", "heads_of", "split_range", "split_sizes", "valid_world_sizes"]
