"""`estimate_memory` / `estimate_speed` of a plain module without inputs: the input follows from its first layer
when that is unambiguous (issue 20 item 11); otherwise the error asking for one, as before."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tpkit import estimate_memory, estimate_speed
from tpkit.estimate.step import infer_input


def _tokens():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 12))


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))


CASES = {"embedding": (_tokens, {"example_input": torch.zeros(1, 8, dtype=torch.long)}, ((1, 8), torch.long)),
         "linear": (_mlp, {"input_shape": (1, 12)}, ((1, 12), torch.float32)),
         "conv2d": (_cnn, {"input_shape": (1, 3, 32, 32)}, ((1, 3, 32, 32), torch.float32))}


@pytest.mark.parametrize("name", list(CASES))
def test_the_input_follows_from_the_first_layer(name):
    build, explicit, (shape, dtype) = CASES[name]
    model = build()
    x = infer_input(model)
    assert tuple(x.shape) == shape and x.dtype == dtype
    guessed = estimate_memory(model, 2, mode="training")
    given = estimate_memory(model, 2, mode="training", **explicit)
    assert guessed.per_rank == given.per_rank and guessed.single == given.single
    assert guessed.per_rank.activations > 0
    assert any("input inferred from the first layer" in n for n in guessed.notes)


def test_estimate_speed_infers_it_too():
    model = _mlp()
    guessed = estimate_speed(model, [1, 2], mode="training")
    given = estimate_speed(model, [1, 2], mode="training", input_shape=(1, 12))
    assert [r.total_s for r in guessed.rows] == [r.total_s for r in given.rows]


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, y):
        return self.a(x) + self.b(y)


class _HeadFirst(nn.Module):  # registers a layer first that the forward does not run first
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(32, 3)
        self.body = nn.Linear(8, 32)

    def forward(self, x):
        return self.head(self.body(x))


AMBIGUOUS = {"two inputs": _TwoInputs, "norm first": lambda: nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)),
             "registration order is not forward order": _HeadFirst, "no layer": nn.Identity}


@pytest.mark.parametrize("name", list(AMBIGUOUS))
def test_an_ambiguous_model_still_asks_for_an_input(name):
    model = AMBIGUOUS[name]()
    assert infer_input(model) is None
    for estimate in (estimate_memory, estimate_speed):
        with pytest.raises(ValueError, match=r"pass example_input=.* or input_shape="):
            estimate(model, 2, mode="training")
