"""The one protocol for how a tensor enters its module's forward (`tpkit.nn.rewrites`): a registry by name, one
injected class per module that keeps the class's name and the state-dict keys, a public remove, and the registry
kept through a replaced Parameter, `deepcopy` and pickling."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from tpkit.nn.rewrites import Rewrite, adopt, base_class, remove_rewrite, rewrite, rewrites_of, unapplied


class Doubled(Rewrite):
    """Inside the forward the parameter counts twice (a rewrite whose effect a test can see)."""

    def read(self, module, name, stored):
        return stored * 2


class Computed(Rewrite):
    """A weight that is stored as something else and computed at every read (as a quantized weight is)."""

    in_forward_only = False

    def read(self, module, name, stored):
        return module.half_weight.repeat(2, 1)


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 4)


def test_a_rewrite_applies_inside_the_forward_only_and_keeps_names_and_keys():
    m, x = _linear(), torch.randn(2, 3)
    want = torch.nn.functional.linear(x, 2 * m.weight, m.bias)
    keys = list(m.state_dict())
    rewrite(m, "weight", Doubled())
    assert torch.equal(m(x), want)
    assert m.weight is m._parameters["weight"] and isinstance(m.weight, nn.Parameter)  # outside: the Parameter
    assert type(m).__name__ == "Linear" and isinstance(m, nn.Linear) and list(m.state_dict()) == keys
    m.weight = nn.Parameter(m.weight.detach().clone())  # a replaced Parameter is rewritten as well
    assert torch.equal(m(x), want) and set(rewrites_of(m)) == {"weight"}


def test_one_injected_class_per_module_shared_and_removable():
    a, b = _linear(), _linear()
    rewrite(a, "weight", Doubled())
    rewrite(a, "bias", Doubled())
    rewrite(b, "bias", Doubled())
    rewrite(b, "weight", Doubled())
    assert type(a) is type(b) and type(a).__mro__[1] is nn.Linear  # one class per (class, names), kept
    assert len(a._forward_pre_hooks) == 1 and len(a._forward_hooks) == 1
    remove_rewrite(a, "weight")
    assert set(rewrites_of(a)) == {"bias"} and type(a) is not nn.Linear
    remove_rewrite(a, "bias")
    assert type(a) is nn.Linear and not a._forward_pre_hooks and not a._forward_hooks and not rewrites_of(a)
    with pytest.raises(KeyError, match="no rewrite of 'bias'"):
        remove_rewrite(a, "bias")


def test_the_forward_count_is_hooked_only_where_a_rewrite_reads_it():
    """A module whose rewrites all apply everywhere (a quantized weight) carries no hooks: torch then calls it
    without the hooks' path. The first rewrite that applies inside the forward only adds the count, once."""
    m = _linear()
    half = m.weight.detach()[:2].clone()
    del m._parameters["weight"]
    m.register_buffer("half_weight", half)
    rewrite(m, "weight", Computed())
    assert not m._forward_pre_hooks and not m._forward_hooks and not unapplied(m)
    rewrite(m, "bias", Doubled())
    rewrite(m, "bias", Doubled())
    assert len(m._forward_pre_hooks) == 1 and len(m._forward_hooks) == 1 and not unapplied(m)
    x = torch.ones(1, 3)
    assert torch.equal(m(x), torch.nn.functional.linear(x, half.repeat(2, 1), 2 * m._parameters["bias"]))
    assert torch.equal(m.bias, m._parameters["bias"])  # outside the forward: the stored bias
    remove_rewrite(m, "bias")
    remove_rewrite(m, "weight")
    assert not m._forward_pre_hooks and not m._forward_hooks and type(m) is nn.Linear


def test_a_lost_count_hook_is_not_registered_again():
    """A module whose count hook was lost stays named by `unapplied`: a later rewrite does not add a second pair
    (which would count each forward twice, or leave the count at -1 with one hook lost)."""
    m = _linear()
    rewrite(m, "weight", Doubled())
    m._forward_pre_hooks.clear()
    rewrite(m, "bias", Doubled())
    assert len(m._forward_pre_hooks) == 0 and len(m._forward_hooks) == 1
    assert unapplied(m) == ["weight", "bias"]


def test_a_computed_tensor_is_read_everywhere():
    m = _linear()
    half = m.weight.detach()[:2].clone()
    del m._parameters["weight"]
    m.register_buffer("half_weight", half)
    rewrite(m, "weight", Computed())
    assert torch.equal(m.weight, half.repeat(2, 1))
    assert torch.equal(m(torch.ones(1, 3)), torch.nn.functional.linear(torch.ones(1, 3), half.repeat(2, 1), m.bias))
    assert "weight" not in m.state_dict() and "half_weight" in m.state_dict()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_and_pickles_keep_the_registry(how):
    m, x = _linear(), torch.randn(2, 3)
    rewrite(m, "weight", Doubled())
    if how == "deepcopy":
        c = copy.deepcopy(m)
    else:
        buffer = io.BytesIO()
        torch.save(m, buffer)
        buffer.seek(0)
        c = torch.load(buffer, weights_only=False)
    assert type(c) is type(m) and set(rewrites_of(c)) == {"weight"} and torch.equal(c(x), m(x))
    assert rewrites_of(c)["weight"] is not rewrites_of(m)["weight"] or how == "pickle"
    assert not unapplied(c)


def test_a_lost_class_or_hook_is_named():
    model = nn.Sequential(_linear(), _linear())
    rewrite(model[0], "weight", Doubled())
    rewrite(model[1], "bias", Doubled())
    assert not unapplied(model)
    model[0].__class__ = base_class(model[0])  # what a careless wrapper does
    model[1]._forward_pre_hooks.clear()
    assert unapplied(model) == ["0.weight", "1.bias"]


class Louder(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 10


def test_adopt_keeps_the_registry():
    m, x = _linear(), torch.randn(2, 3)
    rewrite(m, "weight", Doubled())
    want = m(x) * 10
    adopt(m, Louder)
    assert isinstance(m, Louder) and torch.equal(m(x), want) and base_class(m) is Louder
    with pytest.raises(TypeError, match="not a subclass"):
        adopt(m, nn.Conv1d)
    again = pickle.loads(pickle.dumps(m))  # noqa: S301 - our own object
    assert isinstance(again, Louder) and torch.equal(again(x), want)
