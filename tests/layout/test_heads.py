"""Head layouts: whole heads, GQA groups intact, KV heads replicated when fewer than ranks; and the pieces
they make of per-head tensors."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkit.layout import HeadLayoutError, Piece, group_pieces, head_columns, head_layout, valid_world_sizes


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
