"""Head layouts: whole heads, GQA groups intact, KV heads replicated when fewer than ranks; and the pieces
they make of per-head tensors."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkit.layout import (HeadLayoutError, Piece, group_pieces, head_columns, head_layout, heads_of,
                          valid_world_sizes)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 12))
def test_layout_properties(nkv, group, world):
    nh = nkv * group
    try:
        lay = head_layout(nh, nkv, world)
    except HeadLayoutError as exc:
        assert world not in valid_world_sizes(nh, nkv) and str(world) in str(exc)
        return
    assert sorted(h for q in lay.q_heads for h in q) == list(range(nh))  # every query head exactly once
    for q, kv in zip(lay.q_heads, lay.kv_heads):
        assert q and kv
        assert sorted({h // group for h in q}) == list(kv)  # exactly the KV heads its query heads read
        counts = [sum(1 for h in q if h // group == k) for k in kv]
        assert len(set(counts)) == 1  # repeat_kv works unchanged: equal query heads per local KV head
    assert lay.kv_replicated == (nkv < world)


def test_known_layouts():
    assert head_layout(8, 2, 4).kv_heads == ((0,), (0,), (1,), (1,))
    assert head_layout(6, 6, 4).q_heads == ((0, 1), (2, 3), (4,), (5,))
    with pytest.raises(HeadLayoutError, match="3 query heads cannot be split over 4 ranks"):
        head_layout(3, 3, 4)


def test_head_columns_and_group_pieces():
    lay = head_layout(4, 2, 3)
    assert head_columns(lay) == Piece(0, 4, tuple((q[0], q[-1] + 1) for q in lay.q_heads))
    pieces = group_pieces(head_layout(4, 2, 2), 8, 2)  # [kv=2, group 2 + 2, hd 8]: rank r holds group r
    assert [p.offset for p in pieces] == [0, 16, 32, 48]
    assert pieces[0].spans == ((0, 16), (0, 0)) and pieces[3].spans == ((0, 0), (0, 16))


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 12))
def test_spread_layout_properties(nkv, group, world):
    """Spread (attentions that expand KV heads): any world size up to the head count; query heads as even as the
    split rule makes them; each rank holds exactly the KV heads its query heads read; the equal-groups layout is
    kept when it is as even (so divisible head counts keep today's exact layout)."""
    nh = nkv * group
    if nh < world:
        with pytest.raises(HeadLayoutError):
            head_layout(nh, nkv, world, spread=True)
        return
    lay = head_layout(nh, nkv, world, spread=True)
    assert sorted(h for q in lay.q_heads for h in q) == list(range(nh))
    assert max(len(q) for q in lay.q_heads) == -(-nh // world)
    for r, (q, kv) in enumerate(zip(lay.q_heads, lay.kv_heads)):
        assert sorted({h // group for h in q}) == list(kv)
        assert sum(lay.kv_repeats(r)) == len(q)
        assert lay.cache_heads(r) == (len(kv) if lay.even_groups(r) else len(q))
        assert heads_of(r, world, nh, nkv, spread=True) == (q, kv)
    if nkv % world == 0 or world % nkv == 0 and nh % world == 0:
        assert lay == head_layout(nh, nkv, world)
    assert world in valid_world_sizes(nh, nkv, spread=True)


def test_spread_known_layouts():
    # Issue 20 item 9: 16 query / 4 KV heads at 3 ranks were 8/4/4 (KV 2/1/1); spread they are 6/5/5 (KV 2/2/2).
    assert [len(q) for q in head_layout(16, 4, 3).q_heads] == [8, 4, 4]
    lay = head_layout(16, 4, 3, spread=True)
    assert lay.q_heads == (tuple(range(6)), tuple(range(6, 11)), tuple(range(11, 16)))
    assert lay.kv_heads == ((0, 1), (1, 2), (2, 3)) and lay.kv_replicated
    assert [lay.kv_repeats(r) for r in range(3)] == [(4, 2), (2, 3), (1, 4)]
    assert lay.counts().startswith("query heads 6/5/5, KV heads 2/2/2")
    # 16/8 at 3: the equal-groups layout 6/6/4 is already as even (max 6), so it is kept (no expansion).
    assert [len(q) for q in head_layout(16, 8, 3, spread=True).q_heads] == [6, 6, 4]
