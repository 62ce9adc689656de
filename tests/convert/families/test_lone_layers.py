"""Lone layers (issue 24): a large linear or conv layer no family could pair is split by its output features and its
output all-gathered (`colwise_rep`), so what reads it sees the whole tensor. Cases: a Mamba-like mixer (its input
projection's output is transposed and convolved per channel, then gated; no row partner), a pooler and a classifier
after a pair, an odd chain of three layers, a conv after a max-pool. Forward, gradients and one AdamW step equal the
unconverted model's in float64 at 2 and 3 ranks (3 ranks cut 40 and 52 features unevenly), in train and eval mode.
Small layers, layers another family keeps whole for a reason of its own (read directly, tied, whole by choice), and
the alternative "whole" stay replicated with their reasons.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpkit.convert import plan
from tpkit.convert.planning.planner import propose
from tpkit.convert.styles import ALONE
from tpkit.convert.trace import analyze_structure

from tests.models.stepcheck import check

DIM, INNER = 24, 40


class Mixer(nn.Module):
    """Mamba's shape: in_proj to x and z, x transposed and convolved per channel (its weight read directly), gated
    by z, out_proj back. Neither projection has a partner the trace can prove."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.in_proj = nn.Linear(DIM, 2 * INNER)
        self.conv1d = nn.Conv1d(INNER, INNER, 3, groups=INNER, padding=2)
        self.out_proj = nn.Linear(INNER, DIM, bias=False)

    def forward(self, h):
        x, z = self.in_proj(self.norm(h)).chunk(2, dim=-1)
        x = F.conv1d(x.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, padding=2, groups=INNER)
        x = F.silu(x[..., :h.shape[1]]).transpose(1, 2)
        return h + self.out_proj(x * F.silu(z))


class Classifier(nn.Module):
    """A pair (up/down), then a pooler on the first token, normalised, and a small classifier: the norm between them
    needs every feature, so the pooler has no partner."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 52), nn.Linear(52, DIM)
        self.pooler, self.classifier = nn.Linear(DIM, DIM), nn.Linear(DIM, 3)

    def forward(self, h):
        h = h + self.down(F.gelu(self.up(h)))
        return self.classifier(F.layer_norm(torch.tanh(self.pooler(h[:, 0])), (DIM,)))


class OddChain(nn.Module):
    """Three layers in a row: the first two pair, the third is alone."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(DIM, INNER), nn.Linear(INNER, DIM), nn.Linear(DIM, INNER)

    def forward(self, h):
        return self.c(torch.relu(self.b(torch.relu(self.a(h)))))


class PooledConvs(nn.Module):
    """A conv pair, a max-pool, then a lone conv (the pool mixes spatial positions, not channels, but the trace
    pairs only through per-feature ops)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 10, 3, padding=1)

    def forward(self, x):
        return self.c3(F.max_pool2d(torch.relu(self.c2(torch.relu(self.c1(x)))), 2))


def tokens() -> torch.Tensor:
    return torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def image() -> torch.Tensor:
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


CASES = {  # model, input, the layers split alone, the layers paired (colwise, rowwise), the layers kept whole
    "mixer": (Mixer, tokens, ("in_proj", "out_proj"), (), ("conv1d",)),
    "classifier": (Classifier, tokens, ("pooler",), ("up", "down"), ("classifier",)),
    "odd_chain": (OddChain, tokens, ("c",), ("a", "b"), ()),
    "convs": (PooledConvs, image, ("c3",), ("c1", "c2"), ()),
}


def build(cls) -> nn.Module:
    torch.manual_seed(91)
    return cls().double()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_lone_layers_split_with_gathered_outputs_are_exact(case, world_size):
    cls, x, alone, paired, whole = CASES[case]
    p = plan(build(cls), world_size, example_inputs=(x(),))
    for n in alone:
        assert p[n] == "colwise_rep" and p.reasons[n].endswith(ALONE), (n, p.entries, p.reasons)
    assert sorted(p.split_alone()) == sorted(alone)
    assert [p[n] for n in paired] == ["colwise", "rowwise"][:len(paired)], p.entries
    for n in whole:
        assert p[n] == "replicate", (n, p.entries)
    for train in (False, True):
        results = check(build(cls), (x(),), world_size, tol=1e-9, train=train)
        assert all(r["plan"][n] == "colwise_rep" for r in results for n in alone)


def test_the_reason_says_what_stopped_the_pairing():
    p = plan(build(Mixer), 2, example_inputs=(tokens(),))
    assert "read directly" in p.reasons["conv1d"]  # the conv's weight is read by F.conv1d: never split
    why = p.split_alone()["in_proj"]
    assert "in_proj" in why and "transpose" in why, why


def test_small_layers_stay_whole():
    """The classifier (3 outputs) holds under 1/8 of the largest layer: a gather would cost more than it frees."""
    p = plan(build(Classifier), 2, example_inputs=(tokens(),))
    assert p["classifier"] == "replicate" and not p.reasons["classifier"].endswith(ALONE)


def test_the_whole_alternative_and_the_search_label():
    a = analyze_structure(build(Mixer), (tokens(),))
    default, proposals = propose(a, 2)
    ours = [q for q in proposals if q.family == "lone_layers"]
    assert sorted(q.key for q in ours) == ["in_proj", "out_proj"]
    assert all([c.label for c in q.choices] == ["split, output gathered", "whole"] for q in ours)
    kept, _ = propose(a, 2, choose={"lone_layers": "whole"})
    assert kept["in_proj"] == kept["out_proj"] == "replicate"
    assert kept.reasons["in_proj"] == default.split_alone()["in_proj"]  # the reason without the split


class Tied(nn.Module):
    """Two square layers sharing one weight, norms between the layers: no pair, and a tie (an output layer after
    them, so the second is no LM head)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.b.weight = self.a.weight

    def forward(self, h):
        return self.out(F.layer_norm(self.b(F.layer_norm(self.a(h), (DIM,))), (DIM,)))


def test_layers_kept_whole_by_choice_or_tie_are_not_split_alone():
    from tests.models.hf import hf_model

    llama = hf_model("llama")
    chosen, _ = propose(analyze_structure(llama), 2, choose={"attention": "whole"})
    assert chosen["model.layers.0.self_attn.q_proj"] == "replicate"  # whole by the setup's choice: stays whole
    assert not chosen.split_alone()
    p = plan(build(Tied), 2, example_inputs=(tokens(),))
    assert p["a"] == p["b"] == "replicate" and p["out"] == "colwise_rep", p.entries


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_holds_the_plain_split_of_the_output_rows(world_size):
    """The shard a rank holds is the plain split of the output rows (what `shard_layouts` and per-rank loading
    read), 40 rows as 20/20 or 14/13/13."""
    import tpkit

    def body(comm, m):
        tp = tpkit.parallelize(m, "auto", comm, example_inputs=(tokens(),))
        lay = tpkit.shard_layouts(tp)["c.weight"]
        return lay.local_shape, tp.c.weight.shape

    copies = [build(OddChain) for _ in range(world_size)]
    got = tpkit.comm.run_threads(lambda comm: body(comm, copies[comm.rank]), world_size)
    sizes = [s[0][0] for s in got]
    assert sum(sizes) == INNER and max(sizes) - min(sizes) <= 1 and all(s[0] == s[1] for s in got)


def test_attention_blocked_with_its_per_head_bias_is_split_alone_like_the_rest():
    """T5 with 4 heads at 5 ranks: no head layout; self-attention (which holds the relative bias) and cross-attention
    are both split alone, with the same reason."""
    from .test_per_head import t5, t5_inputs

    p = plan(t5(heads=4), 5, example_inputs=t5_inputs())
    names = [n for n in p.entries if n.endswith((".SelfAttention.q", ".EncDecAttention.q"))]
    assert names and all(p[n] == "colwise_rep" for n in names), {n: p[n] for n in names}
    assert all("cannot be split over 5 ranks" in p.split_alone()[n] for n in names)
