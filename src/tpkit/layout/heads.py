"""Which attention heads each rank holds: whole heads only, each rank holding the KV heads its query heads
read (a KV head read by query heads of several ranks is held, replicated, by each of them); and the pieces of a
tensor those heads make.

`head_layout` is the one record of "how many heads does rank r hold": the layouts of the q/k/v/o projections,
the attention modules' local head counts, the analyzer's text and the estimate's KV cache all read it.

Two rules, chosen by the caller (the plan's `Role.kv_expand`):

- equal groups (`spread=False`): every KV head a rank holds serves the same number of its query heads, so the
  model's `repeat_kv` works unchanged; GQA groups are kept together (16 heads, 4 KV heads at 3 ranks: 8/4/4
  query heads). Models whose attention cannot take anything else (Falcon's packed [kv, group + 2, hd]) use it.
- spread (`spread=True`): query heads as even as possible, for attentions that can expand their local KV heads
  to one per query head (HF's `num_key_value_groups` set to 1; see `families/attention.py`). The equal-groups
  layout is kept when it is already as even (no rank above ceil(h / n) query heads); otherwise query heads are
  cut by the split rule (16/4 at 3 ranks: 6/5/5 query heads, KV heads 2/2/2, KV heads 1 and 2 on two ranks).
  A rank whose KV heads serve unequal numbers of its query heads (`even_groups(rank)` False) expands them, and
  its KV cache then holds one KV head per local query head (`cache_heads`): the cache grows on such ranks, and
  on every rank that holds a replicated KV head.
"""
from __future__ import annotations

import dataclasses
import functools

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

    @property
    def group(self) -> int:
        """Query heads per KV head in the full model."""
        return self.num_heads // self.num_kv_heads

    def kv_repeats(self, rank: int) -> tuple[int, ...]:
        """For each KV head `rank` holds (in order), how many of its query heads read it."""
        return tuple(sum(1 for h in self.q_heads[rank] if h // self.group == k) for k in self.kv_heads[rank])

    def even_groups(self, rank: int) -> bool:
        """Every KV head `rank` holds serves the same number of its query heads (`repeat_kv` works as is)."""
        return len(set(self.kv_repeats(rank))) <= 1

    def cache_heads(self, rank: int) -> int:
        """KV heads the attention of `rank` sees (and caches): its KV heads, or one per query head when they are
        expanded because its groups are unequal."""
        return len(self.kv_heads[rank]) if self.even_groups(rank) else len(self.q_heads[rank])

    def counts(self) -> str:
        """Per-rank head counts as text: "query heads 6/5/5, KV heads 2/2/2"."""
        q, kv = "/".join(str(len(h)) for h in self.q_heads), "/".join(str(len(k)) for k in self.kv_heads)
        out = f"query heads {q}, KV heads {kv}"
        cache = [self.cache_heads(r) for r in range(self.world_size)]
        if cache != [len(k) for k in self.kv_heads]:
            out += f" (expanded to {'/'.join(map(str, cache))} per query head for attention and the KV cache)"
        return out


def _contiguous(sizes: list[int]) -> list[tuple]:
    out, start = [], 0
    for s in sizes:
        out.append(tuple(range(start, start + s)))
        start += s
    return out


@functools.lru_cache(maxsize=1024)
def head_layout(num_heads: int, num_kv_heads: int, world_size: int, where: str = "attention",
                _hint: bool = True, spread: bool = False) -> HeadLayout:
    """Share `num_heads` query heads and `num_kv_heads` KV heads over `world_size` ranks (see module doc)."""
    if not spread:
        return _equal_groups(int(num_heads), int(num_kv_heads), int(world_size), where, _hint)
    nh, nkv, w = int(num_heads), int(num_kv_heads), int(world_size)
    try:
        lay = _equal_groups(nh, nkv, w, where, False)
        if max(len(q) for q in lay.q_heads) == -(-nh // w):
            return lay
    except HeadLayoutError:
        if nkv < 1 or nh % nkv or nh < w:
            raise
    group = nh // nkv
    q = _contiguous(split_sizes(nh, w))
    kv = [tuple(range(heads[0] // group, heads[-1] // group + 1)) for heads in q]
    return HeadLayout(nh, nkv, w, tuple(q), tuple(kv))


def heads_of(rank: int, world_size: int, num_heads: int, num_kv_heads: int,
             spread: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(query heads, KV heads) that `rank` holds, as global head numbers (see `head_layout`)."""
    lay = head_layout(num_heads, num_kv_heads, world_size, spread=spread)
    return lay.q_heads[rank], lay.kv_heads[rank]


def _equal_groups(nh: int, nkv: int, w: int, where: str, _hint: bool) -> HeadLayout:
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


def valid_world_sizes(num_heads: int, num_kv_heads: int, limit: int = 64, spread: bool = False) -> list[int]:
    """World sizes (up to `limit`) over which these heads can be shared out."""
    out = []
    for w in range(1, min(num_heads, limit) + 1):
        try:
            head_layout(num_heads, num_kv_heads, w, _hint=False, spread=spread)
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
