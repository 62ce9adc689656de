"""An attention module's own parameters (`convert/families/head_params.py`, `convert/trace/head_params.py`):
attention sinks (one per head), a bias of heads x head_dim added after the projection, a per-head gate, are split
with the heads; a vector of head_dim or a scalar every head uses stays whole (gradient summed). Outputs, gradients
and one AdamW step equal the unconverted model's in float64 (rel 1e-9) at 2 and 3 ranks (uneven and spread heads
at 3). A parameter the trace cannot line up with the heads keeps the attention whole, with the reason."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tpkit
from tpkit.convert import Plan, plan

from tests.models.stepcheck import UNPAIRED, check

HD, HIDDEN = 4, 20


class Attention(nn.Module):
    """Plain attention, `extra` picks what it holds itself: "sinks", "qv_bias", "gate", "lambda", "mixed" (a per-head
    parameter softmaxed across heads), "cut" (sinks, and heads combined in halves) or "fed" (a parameter added to
    the input of the projections)."""

    def __init__(self, extra: str, heads: int = 4, kv_heads: int | None = None):
        super().__init__()
        self.extra, self.num_heads, self.head_dim = extra, heads, HD
        self.num_key_value_heads = kv_heads or heads
        self.num_key_value_groups = heads // self.num_key_value_heads
        self.q_proj = nn.Linear(HIDDEN, heads * HD)
        self.k_proj = nn.Linear(HIDDEN, self.num_key_value_heads * HD)
        self.v_proj = nn.Linear(HIDDEN, self.num_key_value_heads * HD)
        self.o_proj = nn.Linear(heads * HD, HIDDEN)
        if extra in ("sinks", "cut", "mixed", "gate", "fed"):
            self.sinks = nn.Parameter(torch.randn(heads))
        if extra == "qv_bias":
            self.q_bias = nn.Parameter(torch.randn(heads * HD))
            self.v_bias = nn.Parameter(torch.randn(heads * HD))
        if extra == "lambda":
            self.lambda_q = nn.Parameter(torch.randn(HD))
            self.lambda_k = nn.Parameter(torch.randn(HD))
            self.scale = nn.Parameter(torch.randn(HD))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], -1, HD).transpose(1, 2)

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:  # Llama's repeat_kv
        b, n, s, d = x.shape
        g = self.num_key_value_groups
        return x if g == 1 else x[:, :, None].expand(b, n, g, s, d).reshape(b, n * g, s, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        if self.extra == "fed":  # the parameter reaches the projections' input, not the heads
            x = x + self.sinks.sum()
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        if self.extra == "qv_bias":  # DeBERTa: per-head biases after the projection, viewed as the heads
            q = q + self._heads(self.q_bias[None, None, :])
            v = v + self._heads(self.v_bias[None, None, :])
        if self.extra == "lambda":  # one vector of head_dim every head uses
            q = q * self.scale
        k, v = self._repeat(k), self._repeat(v)
        scores = q @ k.transpose(-1, -2) / HD ** 0.5
        if self.extra in ("sinks", "cut"):  # gpt-oss: one extra logit per head, dropped after the softmax
            sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)
            probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out = probs @ v
        if self.extra == "gate":  # a per-head gate broadcast over head_dim
            out = out * torch.sigmoid(self.sinks[None, :, None, None])
        if self.extra == "mixed":  # the per-head parameter mixes across heads first
            out = out * self.sinks.softmax(0).view(1, -1, 1, 1)
        if self.extra == "lambda":  # DiffLlama: a scalar from head_dim vectors
            out = out * torch.exp((self.lambda_q * self.lambda_k).sum())
        out = out.transpose(1, 2)
        if self.extra == "cut":  # heads h and h + heads/2 combined (a differential attention)
            one, two = out.chunk(2, dim=2)
            out = torch.cat([one - 0.5 * two, two], dim=2)
        return self.o_proj(out.reshape(b, s, -1))


class Model(nn.Module):
    def __init__(self, extra: str, heads: int = 4, kv_heads: int | None = None):
        super().__init__()
        self.attn = Attention(extra, heads, kv_heads)
        self.head = nn.Linear(HIDDEN, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.attn(x))


def model(extra: str, heads: int = 4, kv_heads: int | None = None) -> nn.Module:
    torch.manual_seed(3)
    return Model(extra, heads, kv_heads).double()


X = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
KINDS = {"sinks": {"sinks": "heads"}, "gate": {"sinks": "heads"},
         "qv_bias": {"q_bias": "head_features", "v_bias": "head_features"},
         "lambda": {"lambda_q": "shared", "lambda_k": "shared", "scale": "shared"}}


@pytest.mark.parametrize("extra", sorted(KINDS))
def test_plan_splits_the_attention_and_says_how_each_parameter_follows_the_heads(extra):
    p = plan(model(extra), 2, example_inputs=X)
    assert p["attn.q_proj"] == "colwise" and p["attn.o_proj"] == "rowwise"
    assert p["attn"] == "head_parameters" and dict(p.details["attn"].params) == KINDS[extra]
    again = Plan.from_json(p.to_json())  # a saved plan replays with the same facts
    assert again["attn"] == "head_parameters" and again.details["attn"] == p.details["attn"]


@pytest.mark.parametrize("world_size", [2, 3])  # 4 heads at 3 ranks: 2, 1, 1
@pytest.mark.parametrize("extra", sorted(KINDS))
def test_outputs_gradients_and_a_step_equal_the_unconverted_model(extra, world_size):
    results = check(model(extra), X, world_size, tol=1e-9)
    layouts = results[0]["plan"]
    assert layouts is not None


@pytest.mark.parametrize("extra", ["sinks", "gate"])
def test_spread_heads_at_three_ranks(extra):
    """4 query heads over 2 KV heads at 3 ranks: query heads spread 2, 1, 1 (KV heads expanded where needed)."""
    m = model(extra, heads=4, kv_heads=2)
    p = plan(m, 3, example_inputs=X)
    assert p["attn"] == "head_parameters" and p.details["attn.o_proj"].kv_expand
    check(m, X, 3, tol=1e-9)


def test_split_parameters_have_their_heads_layout():
    """The layout the conversion cut the parameter by is the one `shard_layouts` (and checkpoints) read."""
    def body():
        comm = tpkit.get_communicator()
        m = copies[comm.rank]
        tpkit.parallelize(m, "auto", comm, example_inputs=X)
        lays = tpkit.shard_layouts(m)
        return {k: (lays[k].local_shape, lays[k].shard(full[k]).equal(m.state_dict()[k]))
                for k in ("attn.sinks", "attn.q_bias") if k in lays}

    for extra, key in (("sinks", "attn.sinks"), ("qv_bias", "attn.q_bias")):
        m = model(extra)
        full = m.state_dict()
        copies = [model(extra) for _ in range(3)]
        got = tpkit.launch(body, 3, backend="threads")
        width = 1 if extra == "sinks" else HD
        assert [g[key][0] for g in got] == [(2 * width,), (width,), (width,)]
        assert all(g[key][1] for g in got)


@pytest.mark.parametrize("extra, why", [
    ("mixed", "cannot line up with 4 heads"),
    ("cut", "cut or joined along an axis of the head count"),
    ("fed", "reaches a layer's input"),
])
def test_parameters_not_proven_to_follow_the_heads_keep_the_attention_whole(extra, why):
    p = plan(model(extra), 2, example_inputs=X)
    for n in ("attn.q_proj", "attn.o_proj"):
        assert p[n] in UNPAIRED and why in p.reasons[n], p.reasons[n]
    assert "attn" not in p or p["attn"] == "replicate"
    check(model(extra), X, 2, tol=1e-9)


def test_a_saved_plan_replays_and_gloo_processes_agree():
    """The plan as JSON converts the same (threads), and the same check holds on real gloo processes."""
    p = plan(model("qv_bias"), 2, example_inputs=X)
    check(model("qv_bias"), X, 2, plan=Plan.from_json(p.to_json()), tol=1e-9)
    check(model("sinks"), X, 2, tol=1e-9, backend="gloo")
