"""Unknown packings: when a projection's output is rearranged in a way the planner cannot prove (an interleaved
rotary over the whole projection, a grouped layout whose module states no KV head count, heads on the last axis),
or fused qkv has fewer KV heads than ranks, that attention stays whole with the reason in the
plan; the model converts exactly (forward and one AdamW step, float64, world sizes 2 and 3) and never crashes."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpkit.convert import plan

from tests.models.stepcheck import UNPAIRED, check

DIM, HEADS, HD, SEQ = 48, 6, 8, 5


def _attend(q, k, v):
    att = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
    return (att @ v).transpose(1, 2).flatten(2)


class _Base(nn.Module):
    """Attention + MLP; subclasses say how q, k, v come out of the projections."""

    def __init__(self, qkv_width: int = 3 * DIM):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, HD
        self.qkv = nn.Linear(DIM, qkv_width)
        self.o = nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 96), nn.Linear(96, DIM)

    def forward(self, x):
        q, k, v = self.heads(x)
        x = x + self.o(_attend(q, k, v))
        return x + self.down(F.gelu(self.up(x)))


class InterleavedRotary(_Base):
    """Separate q/k/v; a rotary over the whole projection on interleaved pairs (2i, 2i+1) with frequency i, before
    the reshape to heads: a rank's shard would get the wrong frequencies."""

    def __init__(self):
        super().__init__()
        del self.qkv
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM) for _ in range(3))
        pos = torch.arange(SEQ, dtype=torch.float64)[:, None] * torch.arange(DIM // 2, dtype=torch.float64)[None]
        self.register_buffer("cos", (0.3 * pos).cos(), persistent=False)
        self.register_buffer("sin", (0.3 * pos).sin(), persistent=False)

    def rot(self, t):
        a, b = t[..., ::2], t[..., 1::2]
        return torch.stack((a * self.cos - b * self.sin, a * self.sin + b * self.cos), -1).flatten(-2)

    def heads(self, x):
        b, s, _ = x.shape
        q, k, v = self.rot(self.wq(x)), self.rot(self.wk(x)), self.wv(x)
        return [t.view(b, s, HEADS, HD).transpose(1, 2) for t in (q, k, v)]


class GroupedQKV(_Base):
    """Falcon-style grouped layout: per KV head, its `group` query heads then its key and value."""

    def __init__(self, kv: int = 2):
        self.kv, self.group = kv, HEADS // kv
        super().__init__((HEADS + 2 * kv) * HD)

    def heads(self, x):
        b, s, _ = x.shape
        g = self.qkv(x).view(b, s, self.kv, self.group + 2, HD)
        q = g[:, :, :, : self.group].reshape(b, s, HEADS, HD).transpose(1, 2)
        k = g[:, :, :, self.group:self.group + 1].expand(-1, -1, -1, self.group, -1).reshape(b, s, HEADS, HD)
        v = g[:, :, :, self.group + 1:].expand(-1, -1, -1, self.group, -1).reshape(b, s, HEADS, HD)
        return q, k.transpose(1, 2), v.transpose(1, 2)


class HeadsLast(_Base):
    """Each projection viewed as [head_dim, heads]: a head is every 6th feature, not a contiguous block."""

    def __init__(self):
        super().__init__()
        del self.qkv
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM) for _ in range(3))

    def heads(self, x):
        b, s, _ = x.shape
        return [f(x).view(b, s, HD, HEADS).permute(0, 3, 1, 2) for f in (self.wq, self.wk, self.wv)]


class RotateHalfWhole(InterleavedRotary):
    """rotate_half (non-interleaved) over the whole projection, before the reshape to heads."""

    def rot(self, t):
        a, b = t.chunk(2, -1)
        return torch.cat((-b, a), -1) * 0.5 + t


class PerHeadScale(_Base):
    """A learned per-head temperature held by the attention module itself, used on the scores."""

    def __init__(self):
        super().__init__()
        del self.qkv
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM) for _ in range(3))
        self.head_scale = nn.Parameter(torch.linspace(0.5, 1.5, HEADS))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, -1, HD).transpose(1, 2) for f in (self.wq, self.wk, self.wv))
        att = (q @ k.transpose(-1, -2) * self.head_scale.view(1, -1, 1, 1)).softmax(-1)
        x = x + self.o((att @ v).transpose(1, 2).flatten(2))
        return x + self.down(F.gelu(self.up(x)))


CASES = {"per_head_scale": (PerHeadScale, "the model itself holds ['head_scale']"),"interleaved_rotary": (InterleavedRotary, "rearranged across its features"),
         "grouped_qkv": (GroupedQKV, "not split into q, k, v pieces"),
         "heads_last": (HeadsLast, "no reshape to heads of size 8"),
         "rotate_half_whole": (RotateHalfWhole, "rearranged across its features")}


def build(cls) -> nn.Module:
    torch.manual_seed(31)
    return cls().double()


def x() -> torch.Tensor:
    return torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(6), dtype=torch.float64)


@pytest.mark.parametrize("case", sorted(CASES))
def test_unproven_packing_stays_whole_with_reason(case):
    cls, why = CASES[case]
    p = plan(build(cls), 2, example_inputs=(x(),))
    assert p["o"] in UNPAIRED and why in p.reasons["o"], p.reasons["o"]
    assert p["up"] == "colwise" and p["down"] == "rowwise"  # the MLP still splits


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_unproven_packing_is_exact(case, world_size):
    check(build(CASES[case][0]), (x(),), world_size)


# Fused qkv with fewer KV heads than ranks.
tr = pytest.importorskip("transformers")


def phi3(heads: int, kv: int) -> nn.Module:
    cfg = tr.Phi3Config(vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(32)
    return tr.Phi3ForCausalLM(cfg).double()


def bigcode_mqa() -> nn.Module:
    cfg = tr.GPTBigCodeConfig(vocab_size=101, n_embd=48, n_layer=1, n_head=6, n_positions=64, multi_query=True,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(33)
    return tr.GPTBigCodeForCausalLM(cfg).double()


def ids() -> dict:
    return {"input_ids": torch.randint(2, 101, (2, 6), generator=torch.Generator().manual_seed(8))}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("heads,kv", [(6, 1), (6, 2), (8, 2)])
def test_fused_qkv_with_few_kv_heads(heads, kv, world_size):
    """Phi-3's fused qkv with fewer KV heads than ranks: KV heads replicated on the ranks that read them; where a
    rank's query heads use their KV heads unequally (8 heads in 2 groups over 3 ranks: 3/3/2, rank 1 reads KV
    heads 0 and 1) the packed projection's k and v parts are expanded to one KV head per query head (it used to
    stay whole)."""
    p = plan(phi3(heads, kv), world_size, example_inputs=ids())
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert p[qkv] == "colwise", p.reasons.get(qkv)
    check(phi3(heads, kv), ids(), world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_multi_query_fused_kv(world_size):
    """GPT-BigCode multi-query: `c_attn(x).unsqueeze(1).split((E, hd, hd))`, the key one head never reshaped
    (transposed for the scores): split by heads, the key and value head on every rank (it used to stay whole)."""
    p = plan(bigcode_mqa(), world_size, example_inputs=ids())
    attn = "transformer.h.0.attn.c_attn"
    assert p[attn] == "colwise" and p.details[attn].pieces == (48, 8, 8), p.reasons.get(attn)
    check(bigcode_mqa(), ids(), world_size)  # 1e-6: its key bias has no gradient, Adam steps on rounding noise
