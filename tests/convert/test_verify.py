"""`verify`: a lost gradient is a failure, and the transposed-weight check goes by module type."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tpkit.convert import verify


class ScaledMLP(nn.Module):
    """Multiplies by `scale` (all ones) only while `down` is still a plain nn.Linear: after conversion the
    output is the same but `scale` gets no gradient, which verify must report rather than skip."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 24), nn.Linear(24, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        y = self.down(torch.relu(self.up(x)))
        return y * self.scale if type(self.down) is nn.Linear else y


@pytest.mark.parametrize("world", [2, 3])
def test_gradient_missing_in_the_parallel_model_fails(world):
    torch.manual_seed(0)
    report = verify(ScaledMLP, torch.randn(4, 8, dtype=torch.float64).float(), world_size=world, backward=True)
    lost = [g for g in report.gradients if g.name.startswith("scale")]
    assert len(lost) == 1 and not lost[0].ok and lost[0].max_abs_error == float("inf")
    assert "no gradient in the parallel model" in lost[0].name and "scale" in report.summary()
    assert not report.ok and report.max_abs_error == float("inf")
    assert all(g.ok for g in report.gradients if not g.name.startswith("scale"))


class NamedLinear(nn.Linear):
    """A plain linear layer that happens to carry attributes named like GPT-2 Conv1D's (`nf`, `nx`)."""

    def __init__(self, n_in, n_out):
        super().__init__(n_in, n_out)
        self.nf, self.nx = n_out, n_in


@pytest.mark.parametrize("world", [1, 2, 4])
def test_linear_with_nf_nx_attributes_is_not_taken_for_conv1d(world):
    torch.manual_seed(0)
    model = nn.Sequential(NamedLinear(8, 16), nn.ReLU(), NamedLinear(16, 8))
    report = verify(model, torch.randn(3, 8), world_size=world, backward=True)
    assert report.ok, report.summary()
    assert {g.name for g in report.gradients} == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_one_tensor_input_is_traced_as_one_argument():
    """A bare tensor as example input is the model's one argument (as verify calls it), not a tuple of rows:
    the auto plan then splits the MLP instead of replicating it for want of a trace."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    report = verify(model, torch.randn(5, 8), world_size=2, backward=True)
    assert report.ok and report.plan["entries"] == {"0": "colwise", "2": "rowwise"}, report.plan


class NudgedGradient(nn.Module):
    """An MLP whose output is the same on every world size, but whose `scale` gradient is off by `rel`
    (relative) once the model runs on more than one rank: a real error that verify must catch."""

    def __init__(self, rel: float):
        super().__init__()
        self.up, self.down = nn.Linear(8, 24), nn.Linear(24, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.rel = rel

    def forward(self, x):
        import tpkit

        s = self.scale
        if tpkit.get_communicator().world_size > 1:  # same value, gradient times (1 + rel)
            s = s + self.rel * (s - s.detach())
        return self.down(torch.relu(self.up(x))) * s


@pytest.mark.parametrize("world", [2, 3])
def test_a_real_gradient_error_of_1e_3_fails(world):
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    bad = verify(NudgedGradient(1e-3), x, world_size=world, backward=True, rtol=1e-4)
    scale = [g for g in bad.gradients if g.name == "scale"][0]
    assert not bad.ok and not scale.ok and scale.max_rel_error > 5e-4, bad.summary()
    assert all(o.ok for o in bad.outputs)
    good = verify(NudgedGradient(0.0), x, world_size=world, backward=True, rtol=1e-4)
    assert good.ok, good.summary()


def test_rounding_noise_on_a_zero_gradient_passes_and_is_reported():
    """A conv bias before BatchNorm (training) has gradient 0 in theory: only rounding noise, judged against the
    layer's largest gradient (rtol x that), not against ~0. The report shows the error and what was allowed."""
    from tests.models.custom import cnn

    torch.manual_seed(0)
    model = cnn().train(True)
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    report = verify(model, (x,), world_size=3, backward=True, rtol=1e-5)
    assert report.ok, report.summary()
    bias = [g for g in report.gradients if g.name == "0.bias"][0]
    weight = [g for g in report.gradients if g.name == "0.weight"][0]
    assert 0 < bias.tolerance < weight.tolerance and "allowed" in report.summary()
