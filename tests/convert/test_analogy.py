"""Modules the traced forward did not run are split like a traced module of the same class (a decoder's
cross-attention, traced without encoder states), and run right when they do run."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tpkit
from tpkit.comm import run_threads


class Attention(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))
        self.num_heads, self.head_dim = heads, d // heads

    def forward(self, x, states=None):
        kv = x if states is None else states
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(kv).view(b, kv.shape[1], -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(kv).view(b, kv.shape[1], -1, self.head_dim).transpose(1, 2)
        a = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim ** 0.5, -1) @ v
        return self.out_proj(a.transpose(1, 2).reshape(b, t, -1))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.cross_attn = Attention(), Attention()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x, states=None):
        x = x + self.self_attn(x)
        if states is not None:
            x = x + self.cross_attn(x, states)
        return x + self.down(torch.relu(self.up(x)))


def test_an_untraced_twin_is_split_like_the_traced_one_and_runs_right():
    torch.manual_seed(0)
    model = Decoder().double()
    x, states = torch.randn(2, 5, 32, dtype=torch.double), torch.randn(2, 7, 32, dtype=torch.double)
    ref = model(x, states)

    def body(comm):
        m = tpkit.parallelize(copy.deepcopy(model), comm=comm, example_inputs=(x,))  # cross_attn does not run
        return m(x, states), m.tp_plan

    for out, plan in run_threads(body, 2):
        assert plan["cross_attn.q_proj"] == "colwise" and plan["cross_attn.out_proj"] == "rowwise"
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


class Tower(nn.Module):
    """A model of its own (a config and a main input name), as a Hugging Face vision tower is."""

    main_input_name = "pixel_values"

    def __init__(self):
        super().__init__()
        import types

        self.config = types.SimpleNamespace(image_size=4, num_channels=2)
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, pixel_values):
        x = pixel_values.flatten(1)
        return x + self.down(torch.relu(self.up(x)))


class TwoTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision = Tower()
        self.text_up, self.text_down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x, pixel_values=None):
        if pixel_values is not None:
            x = x + self.vision(pixel_values)
        return x + self.text_down(torch.relu(self.text_up(x)))


@pytest.mark.parametrize("main_input_name", ["pixel_values", "input_ids"])  # input_ids: inherited, and wrong
def test_an_untraced_tower_is_traced_alone_and_runs_right(main_input_name):
    torch.manual_seed(0)
    model = TwoTowers().double()
    model.vision.main_input_name = main_input_name
    x, pixels = torch.randn(3, 32, dtype=torch.double), torch.randn(3, 2, 4, 4, dtype=torch.double)
    ref = model(x, pixels)

    def body(comm):
        m = tpkit.parallelize(copy.deepcopy(model), comm=comm, example_inputs=(x,))  # no image: no tower
        return m(x, pixels), m.tp_plan

    for out, plan in run_threads(body, 2):
        assert plan["vision.up"] == "colwise" and plan["vision.down"] == "rowwise"
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


class Projector(nn.Module):
    """What sits between a tower and a language model: plain layers, no config."""

    def __init__(self):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(32, 48), nn.Linear(48, 32)

    def forward(self, x):
        return self.linear_2(torch.nn.functional.gelu(self.linear_1(x)))


class TowerWithProjector(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision = Tower()
        self.vision.odd = nn.Conv1d(2, 2, 1)  # a layer the tower runs that no rule splits
        self.projector = Projector()
        self.text_up, self.text_down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x, pixel_values=None):
        if pixel_values is not None:
            x = x + self.projector(self.vision(pixel_values))
        return x + self.text_down(torch.relu(self.text_up(x)))


def _run_odd(self, pixel_values):
    x = self.odd(pixel_values.flatten(2)).flatten(1)
    return x + self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("world", [2, 3])
def test_an_untraced_projector_is_traced_alone_and_reasons_are_its_own(world, monkeypatch):
    monkeypatch.setattr(Tower, "forward", _run_odd)
    torch.manual_seed(0)
    model = TowerWithProjector().double()
    x, pixels = torch.randn(3, 32, dtype=torch.double), torch.randn(3, 2, 4, 4, dtype=torch.double)
    ref = model(x, pixels)
    ref.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    def body(comm):
        m = tpkit.parallelize(copy.deepcopy(model), comm=comm, example_inputs=(x,))  # no image: no tower, projector
        out = m(x, pixels)
        out.sum().backward()
        return out, m.tp_plan, {n: p.grad for n, p in m.named_parameters()}

    for out, plan, got in run_threads(body, world):
        assert plan["projector.linear_1"] == "colwise" and plan["projector.linear_2"] == "rowwise"
        assert plan["vision.up"] == "colwise"
        # the tower ran in its own trace: the conv's reason is the planner's, not "not run in the traced forward"
        assert "not run" not in plan.kept_whole()["vision.odd"]
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        full = grads["projector.linear_2.weight"]
        assert got["projector.linear_2.weight"].shape[1] < full.shape[1]  # really split
        torch.testing.assert_close(got["vision.odd.weight"], grads["vision.odd.weight"], rtol=1e-10, atol=1e-12)


def test_a_tower_whose_forward_takes_no_main_input_gets_a_batch_for_its_first_layer():
    """An audio encoder inheriting `main_input_name = "input_ids"` whose forward reads `hidden_states`."""
    import types

    from tpkit.convert.trace.structure import default_inputs

    class Encoder(nn.Module):
        main_input_name = "input_ids"

        def __init__(self):
            super().__init__()
            self.config = types.SimpleNamespace()
            self.input_linear, self.out = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, hidden_states):
            return self.out(torch.relu(self.input_linear(hidden_states)))

    first = default_inputs(Encoder())[0]
    assert first[0].dtype.is_floating_point and first[0].shape[-1] == 8
