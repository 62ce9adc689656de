"""Attention split by heads converts exactly for random head counts and world sizes."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkit.convert import plan, verify

from tests.models.custom import Block


@settings(max_examples=6, deadline=None)
@given(st.integers(2, 6), st.sampled_from([2, 4]), st.integers(4, 24), st.integers(1, 4))
def test_random_blocks_verify(n_heads, head_dim, hidden, world):
    torch.manual_seed(0)
    model = Block(dim=n_heads * head_dim, n_heads=n_heads, hidden=hidden)
    p = plan(model, world)
    by_heads = p["wq"] == "colwise"  # otherwise whole, or split alone with a gathered output
    assert by_heads == (n_heads >= world), (p.entries, p.reasons.get("wq"))
    x = torch.randn(2, 3, n_heads * head_dim, generator=torch.Generator().manual_seed(1))
    report = verify(model, (x,), world_size=world, backward=True)
    assert report.ok, report.summary()
