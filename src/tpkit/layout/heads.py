"""Which attention heads each rank holds: whole heads only, GQA groups kept together, KV heads replicated
when there are fewer of them than ranks; and the pieces of a tensor those heads make.

A rank must hold, for every query head it owns, the key/value head that query head reads; and for the
model's `repeat_kv` to work unchanged, every KV head a rank holds must serve the same number of its query
heads. The layouts below satisfy both, or raise `HeadLayoutError` saying why and which world sizes work.
"""
from __future__ import annotations

import dataclasses

from .shard import Piece
from .split import split_sizes


class HeadLayoutError(ValueError):
    """The heads cannot be shared out over this world size without breaking a head or a GQA group."""


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Per rank: the query heads and the KV heads it holds (global head numbers, in order)."""

    num_heads: int
    num_kv_heads: int
    world_size: int
    q_heads: tuple  # tuple per rank of head numbers
    kv_heads: tuple

    @property
    def kv_replicated(self) -> bool:
        return sum(len(k) for k in self.kv_heads) > self.num_kv_heads


def _contiguous(sizes: list[int]) -> list[tuple]:
    out, start = [], 0
    for s in sizes:
        out.append(tuple(range(start, start + s)))
        start += s
    return out


def head_layout(num_heads: int, num_kv_heads: int, world_size: int, where: str = "attention",
                _hint: bool = True) -> HeadLayout:
    """Share `num_heads` query heads and `num_kv_heads` KV heads over `world_size` ranks (see module doc)."""
    nh, nkv, w = int(num_heads), int(num_kv_heads), int(world_size)
    if nkv < 1 or nh % nkv:
        raise HeadLayoutError(f"{where}: {nh} query heads are not a whole number of groups of {nkv} KV heads")
    group = nh // nkv
    if nh < w:
        raise HeadLayoutError(f"{where}: {nh} query heads cannot be split over {w} ranks (each rank needs at least "
                              f"one whole head); use a world size <= {nh}")
    if nkv >= w:
        # Split the KV heads; each rank takes the query heads of its KV heads (uneven is fine).
        kv = _contiguous(split_sizes(nkv, w))
        q = [tuple(h for k in ks for h in range(k * group, (k + 1) * group)) for ks in kv]
        return HeadLayout(nh, nkv, w, tuple(q), tuple(kv))
    if w % nkv == 0:
        # Fewer KV heads than ranks: w / nkv ranks share each KV head (replicated), splitting its query heads.
        share = w // nkv
        q, kv = [], []
        for k in range(nkv):
            for part in _contiguous(split_sizes(group, share)):
                q.append(tuple(k * group + h for h in part))
                kv.append((k,))
        return HeadLayout(nh, nkv, w, tuple(q), tuple(kv))
    # General case: contiguous query heads; valid only if each rank's heads use their KV heads equally.
    q = _contiguous(split_sizes(nh, w))
    kv = []
    for r, heads in enumerate(q):
        counts: dict[int, int] = {}
        for h in heads:
            counts[h // group] = counts.get(h // group, 0) + 1
        if len(set(counts.values())) != 1:
            raise HeadLayoutError(
                f"{where}: {nh} query heads in {nkv} KV groups cannot be split over {w} ranks: rank {r} would hold "
                f"query heads {heads[0]}..{heads[-1]}, which use KV heads {sorted(counts)} unequally"
                + (f"; world sizes that work: {valid_world_sizes(nh, nkv)}" if _hint else ""))
        kv.append(tuple(sorted(counts)))
    return HeadLayout(nh, nkv, w, tuple(q), tuple(kv))


def valid_world_sizes(num_heads: int, num_kv_heads: int, limit: int = 64) -> list[int]:
    """World sizes (up to `limit`) over which these heads can be shared out."""
    out = []
    for w in range(1, min(num_heads, limit) + 1):
        try:
            head_layout(num_heads, num_kv_heads, w, _hint=False)
        except HeadLayoutError:
            continue
        out.append(w)
    return out


def head_spans(heads_per_rank: tuple, width: int) -> tuple[tuple[int, int], ...]:
    """Each rank's span of a tensor holding `width` entries per head, for contiguous head numbers."""
    return tuple((h[0] * width, (h[-1] + 1) * width) if h else (0, 0) for h in heads_per_rank)


def head_columns(lay: HeadLayout) -> Piece:
    """Each rank's span of a tensor with one entry per query head (T5's relative attention bias columns)."""
    return Piece(0, lay.num_heads, head_spans(lay.q_heads, 1))


def group_pieces(lay: HeadLayout, hd: int, group: int) -> tuple[Piece, ...]:
    """A projection packed per KV group as [kv heads, group + 2, hd] (each group's query heads, then its key and
    value), cut so every rank holds, group by group, its query heads then that group's key and value: the same
    packing with the rank's local head counts (KV heads shared by several ranks are held by each)."""
    out = []
    for k in range(lay.num_kv_heads):
        base, q_spans, kv_spans = k * (group + 2) * hd, [], []
        for r in range(lay.world_size):
            mine = [h - k * group for h in lay.q_heads[r] if h // group == k]
            q_spans.append((mine[0] * hd, (mine[-1] + 1) * hd) if mine else (0, 0))
            kv_spans.append((0, 2 * hd) if k in lay.kv_heads[r] else (0, 0))
        out += [Piece(base, group * hd, tuple(q_spans)), Piece(base + group * hd, 2 * hd, tuple(kv_spans))]
    return tuple(out)
