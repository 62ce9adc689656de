"""Models that are not Hugging Face's: a plain MLP, a hand-written transformer block, a CNN with BatchNorm.
Each converted plan is proven by `verify` (forward and gradients) on thread-ranks."""
from __future__ import annotations

import pytest
import torch

from tpkit.convert import plan, verify

from .custom import block, cnn, mlp


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sequential_mlp(world_size):
    model = mlp()
    p = plan(model, world_size)
    # Linear 0 -> ReLU -> Linear 2 pair up; Linear 4 reads Linear 2's (already reduced) output: no partner, so it
    # is split alone with its output gathered (7 outputs: at 4 ranks too; at 1 rank nothing splits).
    assert p["0"] == "colwise" and p["2"] == "rowwise", p.entries
    assert p["4"] == ("colwise_rep" if world_size > 1 else "replicate"), p.entries
    assert "already paired" in p.reasons["4"]
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(0))
    report = verify(model, (x,), world_size=world_size, backward=True, rtol=1e-5)
    assert report.ok, report.summary()
    assert len(report.gradients) == 6


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_handwritten_transformer_block(world_size):
    """6 heads: at 4 ranks the heads split 2,2,1,1 (whole heads, uneven)."""
    model = block()
    p = plan(model, world_size)
    assert [p[n] for n in ("wq", "wk", "wv", "wo", "fc1", "fc2")] == ["colwise"] * 3 + ["rowwise", "colwise", "rowwise"]
    assert p.details["wq"].head_dim == 8 and p.details["wq"].num_heads == 6
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(1))
    report = verify(model, (x,), world_size=world_size, backward=True, rtol=1e-4)
    assert report.ok, report.summary()


@pytest.mark.parametrize("training", [False, True])
def test_cnn_with_batchnorm(training):
    model = cnn().train(training)
    p = plan(model, 3)
    assert (p["0"], p["1"], p["3"]) == ("colwise", "channelwise", "rowwise"), p.entries
    assert p["4"] == "replicate" and p["8"] == "replicate"
    # rtol 1e-4: in training mode the conv biases before BatchNorm have zero gradient in theory (noise only).
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    for w in (2, 3):
        report = verify(model, (x,), world_size=w, backward=True, rtol=1e-4)
        assert report.ok, report.summary()


def test_a_wrong_plan_is_refused_and_exact_heavy_styles_pass():
    """A plan that splits the MLP pair the wrong way round (or feeds a split output to a replicated layer) is
    refused before anything runs, naming the conflict; the exact but communication-heavy *_rep styles pass."""
    from tpkit.convert.plan import PlanError

    model = mlp()
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(3))
    for wrong, message in (({"0": "rowwise", "2": "colwise"}, "0 is 'rowwise' .* its input comes from no layer"),
                           ({"0": "colwise", "2": "replicate"}, "0 is 'colwise' .* feeds \\['2'\\]")):
        with pytest.raises(PlanError, match="conflicting entries: " + message):
            verify(model, (x,), world_size=2, plan=wrong)
    report = verify(model, (x,), world_size=2, plan={"0": "rowwise_rep", "2": "colwise_rep"}, backward=True)
    assert report.ok, report.summary()
    assert report.plan["entries"]["0"] == "rowwise_rep" and report.plan["entries"]["2"] == "colwise_rep"
