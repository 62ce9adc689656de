"""A pair called several times per forward the same way (ALBERT's one layer shared across depth) is split; the
result equals the unconverted model's."""
from __future__ import annotations

import copy

import torch
from torch import nn

import tpkit
from tpkit.comm import run_threads


class SharedDepth(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.head = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 4)

    def forward(self, x):
        for _ in range(3):  # one layer, three times
            x = x + self.down(torch.tanh(self.up(x)))
        return self.head(x)


def test_a_layer_shared_across_depth_is_split_and_exact():
    torch.manual_seed(0)
    model, x = SharedDepth().double(), torch.randn(2, 5, 16, dtype=torch.double)
    ref = model(x)
    grads = torch.autograd.grad(ref.square().sum(), list(model.parameters()))

    def body(comm):
        m = tpkit.parallelize(copy.deepcopy(model), comm=comm, example_inputs=(x,))
        out = m(x)
        layouts = tpkit.shard_layouts(m)
        got = dict(zip([n for n, _ in m.named_parameters()], torch.autograd.grad(out.square().sum(),
                                                                                  list(m.parameters()))))
        return out, m.tp_plan, {n: (got[n], layouts[n]) for n in got}

    want = dict(zip([n for n, _ in model.named_parameters()], grads))
    for out, plan, got in run_threads(body, 2):
        assert plan["up"] == "colwise" and plan["down"] == "rowwise"
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for n, (g, layout) in got.items():
            torch.testing.assert_close(g, layout.shard(want[n]), rtol=1e-10, atol=1e-12)
