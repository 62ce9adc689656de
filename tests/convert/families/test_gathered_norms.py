"""Norms over all of a split vector's features (issue 24): the layers around them stay split, the norm runs whole
on the features gathered from every rank. Forward, gradients and one AdamW step equal the unconverted model's in
float64 at 2 and 3 ranks (3 ranks cut 40 query features and 72 hidden features unevenly).

- `q_norm(q_proj(x))` and `k_norm(k_proj(x))` over the whole projections (OLMo-2), GQA with 2 KV heads;
- a norm on the joined attention output before o_proj, and one on the MLP's product before down_proj (BitNet);
- dense -> act -> LayerNorm -> decoder (an untied MLM head, RemBert's);
- look-alikes that must not be gathered: a norm whose output also feeds another layer, a tied decoder, and KV heads
  shared by several ranks (the k_norm's features are then no block per rank: the attention stays whole, saying so).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpkit.convert import plan

from tests.models.stepcheck import UNPAIRED, check

DIM, HD, SEQ = 40, 8, 5


class RMSNorm(nn.Module):
    """A float64 RMSNorm (the models' own cast to float32 would hide a wrong gather under rounding)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width) + 0.1 * torch.randn(width))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attend(q, k, v, groups: int = 1):
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    att = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
    return (att @ v).transpose(1, 2).flatten(2)


class QKNorm(nn.Module):
    """OLMo-2: the whole query and key projections normalised before the heads; 5 query heads, `kv` KV heads."""

    def __init__(self, kv: int = 5):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = DIM // HD, kv, HD
        self.num_key_value_groups = self.num_heads // kv
        self.q_proj, self.o_proj = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.k_proj, self.v_proj = nn.Linear(DIM, kv * HD, bias=False), nn.Linear(DIM, kv * HD, bias=False)
        self.q_norm = RMSNorm(DIM)
        self.k_norm = nn.LayerNorm(kv * HD, bias=False)  # a key bias has no gradient: Adam would step on noise
        self.up, self.down = nn.Linear(DIM, 72), nn.Linear(72, DIM)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x)).view(b, s, -1, HD).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(b, s, -1, HD).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, HD).transpose(1, 2)
        x = x + self.o_proj(_attend(q, k, v, self.num_key_value_groups))
        return x + self.down(F.gelu(self.up(x)))


class SubNorms(nn.Module):
    """BitNet: a norm on the attention output before o_proj and on act(gate) * up before down_proj."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = DIM // HD, HD
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.attn_sub_norm = RMSNorm(DIM)
        self.gate, self.up, self.down = nn.Linear(DIM, 72), nn.Linear(DIM, 72), nn.Linear(72, DIM)
        self.ffn_sub_norm = RMSNorm(72)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(self.attn_sub_norm(_attend(q, k, v)))
        return x + self.down(self.ffn_sub_norm(F.silu(self.gate(x)) * self.up(x)))


class MLMHead(nn.Module):
    """dense -> gelu -> LayerNorm -> decoder, the decoder its own weight (RemBert); `tied`: the decoder's weight is
    the embedding's (BERT), which the vocabulary family splits with the embedding."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(96, DIM)
        self.dense, self.norm = nn.Linear(DIM, 72), nn.LayerNorm(72)
        self.decoder = nn.Linear(72 if not tied else DIM, 96)
        if tied:
            self.dense, self.norm = nn.Linear(DIM, DIM), nn.LayerNorm(DIM)
            self.decoder.weight = self.embed.weight

    def forward(self, ids):
        return self.decoder(self.norm(F.gelu(self.dense(self.embed(ids)))))


class NormFeedsTwo(nn.Module):
    """The norm's output also feeds a second layer, which needs all of it: nothing is gathered."""

    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down, self.side = nn.Linear(DIM, 72), nn.LayerNorm(72), nn.Linear(72, DIM), \
            nn.Linear(72, DIM)

    def forward(self, x):
        h = self.norm(F.gelu(self.up(x)))
        return x + self.down(h) + self.side(h)


def build(cls, *args) -> nn.Module:
    torch.manual_seed(61)
    return cls(*args).double()


def x() -> torch.Tensor:
    return torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(6), dtype=torch.float64)


def ids() -> torch.Tensor:
    return torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(6))


GATHERED = {"qk_norm": (QKNorm, x, {"q_proj": "q_norm", "k_proj": "k_norm"}),
            "sub_norms": (SubNorms, x, {"o": "attn_sub_norm", "down": "ffn_sub_norm"}),
            "mlm_head": (MLMHead, ids, {"decoder": "norm"})}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", sorted(GATHERED))
def test_norm_over_split_features_is_gathered_and_exact(case, world_size):
    cls, inputs, layers = GATHERED[case]
    p = plan(build(cls), world_size, example_inputs=(inputs(),))
    for layer, norm in layers.items():
        assert p[norm] == "gathered_norm" and p[layer] in ("colwise", "rowwise"), (p.entries, p.reasons)
    results = check(build(cls), (inputs(),), world_size, tol=1e-9)
    assert all(results[0]["plan"][norm] == "gathered_norm" for norm in layers.values())


def test_kv_heads_shared_by_ranks_keep_the_block_whole():
    """2 KV heads at 3 ranks: a KV head lives on two ranks, so k_norm's features are no block per rank."""
    p = plan(build(QKNorm, 1), 3, example_inputs=(x(),))
    assert p["k_norm"] == "replicate" and p["k_proj"] in UNPAIRED and p["o_proj"] in UNPAIRED, p.entries
    assert "cannot be gathered for the norm" in p.reasons["o_proj"], p.reasons
    assert p["up"] == "colwise"
    check(build(QKNorm, 1), (x(),), 3, tol=1e-9)
    p2 = plan(build(QKNorm, 1), 2, example_inputs=(x(),))  # at 2 ranks the one KV head is whole on both: the
    assert p2["q_proj"] in UNPAIRED  # same reason


@pytest.mark.parametrize("case", ["feeds_two", "tied"])
def test_look_alikes_are_not_gathered(case):
    model, inputs = (build(NormFeedsTwo), x()) if case == "feeds_two" else (build(MLMHead, True), ids())
    p = plan(model, 2, example_inputs=(inputs,))
    assert "gathered_norm" not in set(p.entries.values()), p.entries
    check(model, (inputs,), 2, tol=1e-9)


def test_a_gathered_norm_named_alone_is_refused():
    """A user's plan that gathers a norm whose layers are kept whole says which layer it follows."""
    import tpkit
    from tpkit.convert import parallelize
    from tpkit.convert.errors import PlanError

    models = [build(QKNorm) for _ in range(2)]  # thread-ranks share the RNG: built here, one per rank

    def rank(comm):
        with pytest.raises(PlanError, match="q_proj.*not 'colwise'"):
            parallelize(models[comm.rank], {"*_proj": "replicate", "q_norm": "gathered_norm"}, comm,
                        example_inputs=(x(),))
        return True

    assert all(tpkit.launch(rank, 2, backend="threads", pass_comm=True))
