"""Attention with a gate on its output (a fourth projection, or a second one beside a packed qkv): the gate reaches
the output layer through elementwise ops only, where q, k and v meet in the scores, so the planner splits it with
the query heads. Each variant converts exactly at 2 and 3 ranks (forward and one AdamW step in float64):

- Afmoe / MiniMax: `out * sigmoid(gate(x))` on the flattened output [b, s, heads x hd];
- Beam: `gate(x).view_as(out) + gate_bias[None, None, :, None]` on [b, s, heads, hd], the bias one per head held
  by the attention module;
- HrmText: `sigmoid(gate(x).view(b, s, -1, hd)) * out`;
- Laguna's per-head gate: one value per head, `out.view(b, s, -1, hd) * gate.unsqueeze(-1)`;
- GQA, its query heads spread over the ranks (with a KV head expanded per query head where groups are unequal):
  the gate follows the query heads, never the KV heads.
A gate-like projection whose features or heads are rearranged, of another width, or reading another input keeps
the block whole with the reason, and the converted model is still exact.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpkit.convert import plan
from tpkit.convert.trace.dataflow import trace
from tpkit.layout import head_layout

from tests.models.stepcheck import UNPAIRED, check

DIM, HEADS, HD, SEQ = 32, 4, 8, 5


class _Attention(nn.Module):
    """q/k/v (`kv_heads` KV heads, repeated per query head as `num_key_value_groups` says) and an output layer;
    subclasses say how the gate `g` meets the attention output."""

    def __init__(self, heads: int = HEADS, kv_heads: int = HEADS, head_dim: int = HD, gate_width: int | None = None):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, head_dim
        self.num_key_value_groups = heads // kv_heads
        self.q = nn.Linear(DIM, heads * head_dim)
        self.k = nn.Linear(DIM, kv_heads * head_dim, bias=False)  # a key bias has no gradient: Adam steps on noise
        self.v = nn.Linear(DIM, kv_heads * head_dim)
        self.g = nn.Linear(DIM, heads * head_dim if gate_width is None else gate_width)
        self.o = nn.Linear(heads * head_dim, DIM)

    def heads(self, x):
        """The attention output as [b, s, heads, hd]."""
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        k, v = (t.repeat_interleave(self.num_key_value_groups, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)

    def forward(self, x):
        return self.o(self.gated(x, self.heads(x)).flatten(2))


class FlatGate(_Attention):
    """Afmoe: the gate on the flattened output."""

    def gated(self, x, out):
        return out.flatten(2) * torch.sigmoid(self.g(x))


class HeadedGate(_Attention):
    """HrmText: the gate viewed as heads."""

    def gated(self, x, out):
        return torch.sigmoid(self.g(x).view(*x.shape[:-1], -1, self.head_dim)) * out


class BiasedGate(_Attention):
    """Beam: the gate viewed as the output, plus a bias per head that the attention module holds."""

    def __init__(self):
        super().__init__()
        self.gate_bias = nn.Parameter(torch.randn(HEADS))

    def gated(self, x, out):
        return out * torch.sigmoid(self.g(x).view_as(out) + self.gate_bias[None, None, :, None])


class HeadScalarGate(_Attention):
    """Laguna's per-head gate: one value per head, given a last axis of 1."""

    def __init__(self):
        super().__init__(gate_width=HEADS)

    def gated(self, x, out):
        return out * F.softplus(self.g(x)).unsqueeze(-1)


class PackedGate(nn.Module):
    """MiniMax: a packed qkv viewed as [heads, 3 x hd], and a gate on the flattened output."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, HD
        self.qkv = nn.Linear(DIM, 3 * HEADS * HD, bias=False)
        self.g, self.o = nn.Linear(DIM, HEADS * HD), nn.Linear(HEADS * HD, DIM)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = F.silu(self.qkv(x)).reshape(b, s, self.num_heads, 3 * HD).split(HD, dim=3)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o(torch.sigmoid(self.g(x)) * out.transpose(1, 2).reshape(b, s, -1))


class RolledGate(_Attention):
    """A gate-like projection whose features are rolled before they meet the heads: no head lines up."""

    def gated(self, x, out):
        return out.flatten(2) * torch.sigmoid(self.g(x).roll(1, -1))


class FlippedGate(_Attention):
    def gated(self, x, out):
        return out.flatten(2) * torch.sigmoid(self.g(x).flip(-1))


class FlippedHeadsGate(_Attention):
    """A gate viewed as heads, then its heads reversed: each would gate another head's output."""

    def gated(self, x, out):
        return out * torch.sigmoid(self.g(x).view(*x.shape[:-1], -1, self.head_dim).flip(-2))


class SharedGate(_Attention):
    """One gate vector of head_dim for every head: neither heads x hd nor one value per head."""

    def __init__(self):
        super().__init__(gate_width=HD)

    def gated(self, x, out):
        return out * torch.sigmoid(self.g(x)).unsqueeze(-2)


class TokenGate(_Attention):
    """One gate value per token for every feature."""

    def __init__(self):
        super().__init__(gate_width=1)

    def gated(self, x, out):
        return out.flatten(2) * torch.sigmoid(self.g(x))


class OtherInputGate(_Attention):
    """A gate that reads another tensor than the query does."""

    def gated(self, x, out):
        return out.flatten(2) * torch.sigmoid(self.g(2 * x))


class Block(nn.Module):
    """The attention, then an MLP (which splits whatever the attention does)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.attn = attn
        self.up, self.down = nn.Linear(DIM, 64), nn.Linear(64, DIM)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.down(F.gelu(self.up(x)))


SPLIT = {"flat": (FlatGate, (), "gate"), "headed": (HeadedGate, (), "gate"), "biased": (BiasedGate, (), "gate"),
         "head_scalar": (HeadScalarGate, (), "head_gate"), "packed": (PackedGate, (), "gate"),
         "gqa": (HeadedGate, (HEADS, 2), "gate")}  # 4 query heads, 2 KV heads: 2/1/1 at 3 ranks, KV head 1 on two
WHOLE = {"rolled": (RolledGate, "rearranged across its features"), "flipped": (FlippedGate, "rearranged"),
         "flipped_heads": (FlippedHeadsGate, "cut along its heads"),
         "shared": (SharedGate, f"gives {HD} features"), "token": (TokenGate, "gives 1 features"),
         "other_input": (OtherInputGate, "reads another input")}


def build(cls, *args) -> nn.Module:
    torch.manual_seed(52)
    return Block(cls(*args)).double()


def x() -> torch.Tensor:
    return torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(6), dtype=torch.float64)


def test_only_q_k_v_meet_in_the_scores():
    t = trace(build(FlatGate), (x(),))
    tag = t.first("attn.o").input_tag
    assert tag.sources == {"attn.q", "attn.k", "attn.v", "attn.g"}
    assert tag.attended == {"attn.q", "attn.k", "attn.v"}


@pytest.mark.parametrize("case", sorted(SPLIT))
def test_gate_is_split_with_the_query_heads(case):
    cls, args, role = SPLIT[case]
    p = plan(build(cls, *args), 3, example_inputs=(x(),))
    assert p["attn.g"] == "colwise" and p["attn.o"] == "rowwise", p.reasons
    assert p.details["attn.g"].role == role


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", sorted(SPLIT))
def test_gated_attention_is_exact(case, world_size):
    cls, args, _ = SPLIT[case]
    results = check(build(cls, *args), (x(),), world_size, tol=1e-9)
    assert results[0]["plan"]["attn.g"] == "colwise"


def test_gate_follows_spread_query_heads_not_the_expanded_kv_heads():
    """8 query heads over 2 KV heads at 3 ranks: query heads 3/3/2, rank 1 reads both KV heads unequally and
    expands them; the gate holds exactly the query projection's rows on every rank."""
    lay = head_layout(8, 2, 3, spread=True)
    assert [len(q) for q in lay.q_heads] == [3, 3, 2] and not lay.even_groups(1)
    p = plan(build(FlatGate, 8, 2, 4), 3, example_inputs=(x(),))
    assert p["attn.g"] == "colwise" and p.details["attn.g"].role == "gate" and p.details["attn.o"].kv_expand
    check(build(FlatGate, 8, 2, 4), (x(),), 3, tol=1e-9)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", sorted(WHOLE))
def test_unproven_gate_keeps_the_block_whole(case, world_size):
    cls, why = WHOLE[case]
    p = plan(build(cls), world_size, example_inputs=(x(),))
    assert all(p[n] in UNPAIRED for n in ("attn.g", "attn.o", "attn.q")), p.entries  # no split output
    assert "attn.g" in p.reasons["attn.o"] and why in p.reasons["attn.o"], p.reasons["attn.o"]
    assert p["up"] == "colwise"
    check(build(cls), (x(),), world_size, tol=1e-9)
