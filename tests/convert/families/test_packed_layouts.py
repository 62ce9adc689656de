"""Packed projections whose layout the trace proves (issue 24): each is split by heads (or by pieces) and converts
exactly at 2 and 3 ranks (4 heads at 3 ranks: 2/1/1), forward and one AdamW step in float64; a look-alike that
the trace cannot prove stays whole with the reason.

- [3, heads, hd]: `qkv.view(b, s, 3, heads, hd)` (ModernBert's Wqkv) is [q | k | v], each split by heads;
- [heads + 2, hd] with the query cut as the first `heads` rows (Falcon's multi-query `[..., :-2, :]`): q heads,
  then one key and one value head, which every rank holds;
- `unsqueeze(1).split((E, hd, hd))` (GPT-BigCode's multi-query): the key a single head, never reshaped;
- [2, width / 2] rows taken as `[..., i, :]` (Moshi's gated MLP): the pieces of a chunk(2).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpkit.convert import plan

from tests.models.stepcheck import UNPAIRED, check

DIM, HEADS, HD, SEQ = 32, 4, 8, 5


def _attend(q, k, v):
    att = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
    return (att @ v).transpose(1, 2).flatten(2)


class _Block(nn.Module):
    """Attention + MLP; subclasses say how q, k, v come out of one packed projection `qkv` ([b, heads, s, hd])."""

    def __init__(self, heads: int = HEADS):
        super().__init__()
        d = heads * HD
        self.num_heads, self.head_dim = heads, HD
        self.qkv = nn.Linear(d, self.qkv_width(heads), bias=False)  # a key bias has no gradient: Adam steps on noise
        self.o = nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 64), nn.Linear(64, d)

    def qkv_width(self, heads: int) -> int:
        return 3 * heads * HD

    def forward(self, x):
        q, k, v = self.heads(x)
        x = x + self.o(_attend(q, k, v))
        return x + self.down(F.gelu(self.up(x)))


class ThreeFirst(_Block):
    """ModernBert: [3, heads, hd], unbound on the axis of three."""

    def heads(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, -1, self.head_dim).unbind(dim=-3)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


class MultiQueryRows(_Block):
    """Falcon's multi-query: [heads + 2, hd], query rows first, then one key and one value head."""

    def qkv_width(self, heads: int) -> int:
        return (heads + 2) * HD

    def __init__(self):
        super().__init__()
        self.num_kv_heads = 1

    def heads(self, x):
        b, s, _ = x.shape
        q, k, v = self.rows(self.qkv(x).view(b, s, self.num_heads + 2, self.head_dim))
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def rows(self, g):
        return g[..., :-2, :], g[..., [-2], :], g[..., [-1], :]


class MultiQueryRowsLast(MultiQueryRows):
    """The same projection with the query as the last `heads` rows: nothing says where the query is, as far as
    the planner reads it, so it stays whole."""

    def rows(self, g):
        return g[..., 2:, :], g[..., [0], :], g[..., [1], :]


class MultiQueryPieces(_Block):
    """GPT-BigCode's multi-query: a new axis, then q, k, v cut as pieces; k and v stay one head of hd features."""

    def qkv_width(self, heads: int) -> int:
        return (heads + 2) * HD

    def __init__(self):
        super().__init__()
        self.num_key_value_groups = HEADS

    def heads(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).unsqueeze(1).split((self.num_heads * HD, HD, HD), dim=3)
        return q.view(b, s, -1, self.head_dim).transpose(1, 2), k, v


class StackedGate(nn.Module):
    """Moshi's gated MLP: fc1's output viewed as [2, ffn], act(row 0) * row 1."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 128, bias=False), nn.Linear(64, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.fc1(x).view(b, s, 2, -1)
        return x + self.fc2(F.gelu(h[..., 0, :]) * h[..., 1, :])


SPLIT = {"three_first": (ThreeFirst, "qkv", (DIM, DIM, DIM)),
         "multi_query_rows": (MultiQueryRows, "qkv", (DIM, HD, HD)),
         "multi_query_pieces": (MultiQueryPieces, "qkv", (DIM, HD, HD)),
         "stacked_gate": (StackedGate, "fc1", (64, 64))}


def build(cls, *args) -> nn.Module:
    torch.manual_seed(51)
    return cls(*args).double()


def x(dim: int = DIM) -> torch.Tensor:
    return torch.randn(2, SEQ, dim, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


@pytest.mark.parametrize("case", sorted(SPLIT))
def test_proven_packing_is_split_by_its_pieces(case):
    cls, layer, pieces = SPLIT[case]
    p = plan(build(cls), 2, example_inputs=(x(),))
    assert p[layer] == "colwise", p.reasons.get(layer)
    assert p.details[layer].pieces == pieces


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", sorted(SPLIT))
def test_proven_packing_is_exact(case, world_size):
    results = check(build(SPLIT[case][0]), (x(),), world_size, tol=1e-9)
    assert results[0]["plan"][SPLIT[case][1]] == "colwise"


@pytest.mark.parametrize("world_size", [2, 3])
def test_query_rows_not_first_stay_whole(world_size):
    p = plan(build(MultiQueryRowsLast), world_size, example_inputs=(x(),))
    assert p["qkv"] in UNPAIRED and p["o"] in UNPAIRED and "not split into q, k, v pieces" in p.reasons["o"], p.reasons
    assert p["up"] == "colwise"
    check(build(MultiQueryRowsLast), (x(),), world_size, tol=1e-9)


@pytest.mark.parametrize("world_size", [2, 3])
def test_three_heads_read_either_way_are_exact(world_size):
    """[3, heads, hd] with 3 heads is also [heads, 3, hd]: whichever the planner makes of it, the result must be
    exact. (It was silently wrong, errors up to 6.6: the output's flatten of 3 heads back to 3 x hd was taken for
    GPT-NeoX's reshape to [heads, 3 x hd].)"""
    check(build(ThreeFirst, 3), (x(3 * HD),), world_size, tol=1e-9)
