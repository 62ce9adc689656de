"""Head layouts: whole heads, GQA groups intact, KV heads replicated when fewer than ranks."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkit.convert import plan, verify
from tpkit.convert.heads import HeadLayoutError, head_layout, valid_world_sizes

from .models import Block


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


@settings(max_examples=6, deadline=None)
@given(st.integers(2, 6), st.sampled_from([2, 4]), st.integers(4, 24), st.integers(1, 4))
def test_random_blocks_verify(n_heads, head_dim, hidden, world):
    torch.manual_seed(0)
    model = Block(dim=n_heads * head_dim, n_heads=n_heads, hidden=hidden)
    p = plan(model, world)
    split = p["wq"] != "replicate"
    assert split == (n_heads >= world), (p.entries, p.reasons.get("wq"))
    x = torch.randn(2, 3, n_heads * head_dim, generator=torch.Generator().manual_seed(1))
    report = verify(model, (x,), world_size=world, backward=True)
    assert report.ok, report.summary()
