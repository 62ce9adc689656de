"""The Family protocol from outside tpkit: a toy family registered from this test module (planner, validate and
swap untouched) converts a model exactly; proposals carry alternatives; the registry refuses clashes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpkit
from tpkit.convert import (Choice, Family, PlanError, Proposal, Style, conversion_of, register_family,
                           unregister_family, verify)
from tpkit.convert.planning.planner import propose
from tpkit.convert.trace import analyze_structure
from tpkit.layout import Piece, ShardLayout
from tpkit.nn import copy_to_region, reduce_from_region


class GatedMLP(nn.Module):
    """SwiGLU with its weights as raw parameters: gate and up stacked in one [2 x ff, d] matrix, read with
    F.linear in its own forward, so no nn.Linear pair exists for the built-in families to find."""

    def __init__(self, d: int, ff: int):
        super().__init__()
        self.ff = ff
        self.w_in = nn.Parameter(torch.randn(2 * ff, d, dtype=torch.float64) / d ** 0.5)
        self.w_out = nn.Parameter(torch.randn(d, ff, dtype=torch.float64) / ff ** 0.5)

    def forward(self, x):
        gate, up = F.linear(x, self.w_in).split(self.ff, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_out)


class ParallelGatedMLP(nn.Module):
    """This rank's slice of every intermediate feature: its gate and up rows, its w_out columns; one all-reduce."""

    def __init__(self, m: GatedMLP, layouts, comm):
        super().__init__()
        self.comm = comm
        w_in, w_out = layouts["w_in"], layouts["w_out"]
        self.local_ff = w_out.local_shape[1]
        self.w_in = nn.Parameter(w_in.shard(m.w_in.detach()).clone())   # the layouts are the model's record:
        self.w_out = nn.Parameter(w_out.shard(m.w_out.detach()).clone())  # nothing to set on the Parameters

    def forward(self, x):
        gate, up = F.linear(copy_to_region(x, self.comm), self.w_in).split(self.local_ff, dim=-1)
        return reduce_from_region(F.linear(F.silu(gate) * up, self.w_out), self.comm)


class GatedMLPStyle(Style):
    name = "toy_gated_mlp"
    description = "a GatedMLP split over its intermediate features (gate and up as two pieces); one all-reduce"
    collectives = ("all_reduce",)
    splits = True

    def check(self, name, m, role, world):
        if not isinstance(m, GatedMLP) or m.ff < world:
            raise PlanError(f"{name}: {self.name!r} needs a GatedMLP with at least {world} intermediate features")

    def layouts(self, m, role, world, rank):
        ff, d = m.ff, m.w_out.shape[0]
        return {"w_in": ShardLayout((2 * ff, d), world, rank, 0, (Piece.split(0, ff, world), Piece.split(ff, ff, world))),
                "w_out": ShardLayout((d, ff), world, rank, 1, (Piece.split(0, ff, world),))}

    def build(self, m, layouts, comm, sequence_parallel=False):
        return ParallelGatedMLP(m, layouts, comm)


class GatedMLPs(Family):
    name = "toy_gated_mlp"
    styles = (GatedMLPStyle(),)

    def detect(self, analysis):
        return [n for n, m in analysis.leaves.items() if isinstance(m, GatedMLP)]

    def propose(self, draft, found):
        for name in found:
            if draft.analysis.leaves[name].ff >= draft.world_size:
                yield Proposal(self.name, name, (Choice("split", {name: GatedMLPStyle.name}), Choice("whole")))


def toy_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 12), GatedMLP(12, 10), nn.LayerNorm(12), nn.Linear(12, 5)).double()


@pytest.fixture
def toy_family():
    family = register_family(GatedMLPs())
    try:
        yield family
    finally:
        unregister_family(family.name)


@pytest.mark.parametrize("world", [2, 3])  # 10 intermediate features: 5/5 and 4/3/3
def test_a_family_registered_from_outside_converts_exactly(toy_family, world):
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    p = tpkit.plan(toy_model(), world)
    assert p["1"] == "toy_gated_mlp"
    report = verify(toy_model, (x,), world_size=world, backward=True, rtol=1e-10)
    assert report.ok, report.summary()

    def shapes(comm):
        m = tpkit.parallelize(toy_model(), comm=comm)
        return tuple(m[1].w_in.shape), conversion_of(m).plan["1"]
    got = tpkit.comm.run_threads(shapes, world)
    sizes = tpkit.comm.split_sizes(10, world)
    assert [s for s, _ in got] == [(2 * n, 12) for n in sizes] and {s for _, s in got} == {"toy_gated_mlp"}


def test_without_the_family_the_block_stays_whole():
    p = tpkit.plan(toy_model(), 2)
    assert p["1"] == "replicate" and "no rule splits" in p.reasons["1"]
    with pytest.raises(PlanError, match="unknown style 'toy_gated_mlp'"):
        tpkit.plan(toy_model(), 2, overrides={"1": "toy_gated_mlp"})


def test_proposals_carry_alternatives_and_a_choice_changes_the_plan(toy_family):
    a = analyze_structure(toy_model(), (torch.zeros(2, 6, dtype=torch.float64),))
    plan, proposals = propose(a, 2)
    mine = [p for p in proposals if p.family == "toy_gated_mlp"]
    assert [c.label for c in mine[0].choices] == ["split", "whole"] and plan["1"] == "toy_gated_mlp"
    whole, _ = propose(a, 2, choose={"1": "whole"})
    assert whole["1"] == "replicate"
    with pytest.raises(KeyError, match="no alternative 'halves'"):
        propose(a, 2, choose={"1": "halves"})


def test_attention_alternatives_split_or_whole():
    """Built-in families propose alternatives too: an attention block split by heads, or kept whole."""
    from tests.models.hf import hf_model

    a = analyze_structure(hf_model("llama"))
    plan, proposals = propose(a, 2)
    attn = [p for p in proposals if p.family == "attention"]
    assert len(attn) == 2 and [c.label for c in attn[0].choices] == ["split by heads", "whole"]
    row = attn[0].key
    kept, _ = propose(a, 2, choose={row: "whole"})
    assert plan[row] == "rowwise" and kept[row] == "replicate" and "kept whole by the chosen setup" in kept.reasons[row]
    training, proposals = propose(a, 2, "training")
    sp = next(p for p in proposals if p.family == "sequence_parallel")
    on = sp.choice("on")
    assert sp.choices[0].label == "off" and set(on.entries.values()) == {"sequence_parallel"} and "norms" in on.note


def test_the_registry_refuses_clashes(toy_family):
    with pytest.raises(PlanError, match="already registered"):
        register_family(GatedMLPs())

    class Other(Family):
        name = "other"
        styles = (GatedMLPStyle(),)
    with pytest.raises(PlanError, match="registered twice"):
        register_family(Other())
    with pytest.raises(PlanError, match="no family 'nope' to go before"):
        register_family(type("Late", (Family,), {"name": "late"})(), before="nope")
    with pytest.raises(PlanError, match="no family 'nope' is registered"):
        unregister_family("nope")
