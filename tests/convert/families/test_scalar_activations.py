"""Activations with scalar parameters between a column- and a row-wise layer (issue 24): xIELU's alpha_p / alpha_n
(Apertus), a one-slope PReLU. A shard of features passes through them as through a plain activation, so the MLP
splits; the activation stays whole on every rank and its gradient is summed over the ranks. Forward, gradients and
one AdamW step equal the unconverted model's in float64 at 2 and 3 ranks (3 ranks cut 64 features unevenly). A
scalar-parameter layer that mixes features (a softmax with a learned temperature) keeps the MLP whole.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tpkit.convert import plan

from tests.models.stepcheck import UNPAIRED, check

DIM, FFN = 24, 64


class XIELU(nn.Module):
    """xIELU as transformers writes it (two scalar parameters, two scalar buffers)."""

    def __init__(self):
        super().__init__()
        self.alpha_p, self.alpha_n = nn.Parameter(torch.tensor([0.6])), nn.Parameter(torch.tensor([0.2]))
        self.register_buffer("beta", torch.tensor(0.5))
        self.register_buffer("eps", torch.tensor(-1e-6))

    def forward(self, x):
        alpha_p, alpha_n = nn.functional.softplus(self.alpha_p), self.beta + nn.functional.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)


class Tempered(nn.Module):
    """One scalar parameter, but the softmax mixes the features."""

    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return torch.softmax(x * self.t, -1)


class MLP(nn.Module):
    def __init__(self, act: nn.Module):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(DIM, FFN), act, nn.Linear(FFN, DIM)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


ACTS = {"xielu": XIELU, "prelu": nn.PReLU}


def build(act) -> nn.Module:
    torch.manual_seed(71)
    return MLP(act()).double()


def x() -> torch.Tensor:
    return torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("act", sorted(ACTS))
def test_scalar_activation_is_passed_and_exact(act, world_size):
    p = plan(build(ACTS[act]), world_size, example_inputs=(x(),))
    assert (p["up"], p["act"], p["down"]) == ("colwise", "replicated_with_grad_allreduce", "rowwise"), p.reasons
    check(build(ACTS[act]), (x(),), world_size, tol=1e-9)


def test_a_model_on_meta_plans_the_same():
    with torch.device("meta"):
        meta = MLP(XIELU()).double()
    assert plan(meta, 2, example_inputs=(x().to("meta"),)).entries == plan(build(XIELU), 2,
                                                                            example_inputs=(x(),)).entries


def test_scalar_layer_that_mixes_features_keeps_the_mlp_whole():
    p = plan(build(Tempered), 2, example_inputs=(x(),))
    assert p["up"] in UNPAIRED and p["down"] in UNPAIRED, p.entries  # no pair: nothing stays split
    check(build(Tempered), (x(),), 2, tol=1e-9)
