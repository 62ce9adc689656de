"""The trace's forward on a model whose parameters are on the meta device beside real buffers (as
`from_pretrained` builds it): the buffers are seen as meta for that forward, the model finds the pairs a model
built wholly on meta finds, and afterwards (or after a forward that fails) holds the very same real buffers."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from tpkit.convert.trace import analyze_structure
from tpkit.convert.trace.state import run_once


class _Biased(nn.Module):
    """An MLP whose input gets a buffer added (as a router's scores get its correction bias) and whose output is
    scaled by a tensor attribute."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.register_buffer("bias", torch.arange(8.0))
        self.scale = torch.full((8,), 2.0)
        self.fail = fail

    def forward(self, x):
        if self.fail:
            self.bias = torch.zeros(8)  # reassigned before failing: must be undone too
            raise RuntimeError("boom")
        return self.down(torch.relu(self.up(x + self.bias))) * self.scale


def _meta_parameters(m: nn.Module) -> nn.Module:
    for sub in m.modules():
        for k, p in list(sub._parameters.items()):
            sub._parameters[k] = nn.Parameter(p.detach().to("meta"))
    return m


def test_real_buffers_beside_meta_parameters_trace_as_on_meta():
    model = _meta_parameters(_Biased())
    bias, scale = model.bias, model.scale
    a = analyze_structure(model)
    assert a.trace_error is None, a.trace_error
    with torch.device("meta"):
        wholly = _Biased()
    assert [(p.columns, p.row) for p in a.pairs] == [(p.columns, p.row) for p in analyze_structure(wholly).pairs]
    assert [(p.columns, p.row) for p in a.pairs] == [(("up",), "down")]
    assert model.bias is bias and model.scale is scale and not bias.is_meta and not scale.is_meta


def test_buffers_put_back_after_a_failing_forward():
    model = _meta_parameters(_Biased(fail=True))
    bias, scale = model.bias, model.scale
    with pytest.raises(RuntimeError, match="boom"):
        run_once(model, (torch.zeros(2, 8, device="meta"),), contextlib.nullcontext())
    assert model.bias is bias and model.scale is scale and not bias.is_meta
    assert set(model._buffers) == {"bias"}


def test_a_model_with_real_parameters_is_left_alone():
    from tpkit.convert.trace.state import real_tensors_as_meta

    model = _Biased()
    with real_tensors_as_meta(model.modules()):
        assert not model.bias.is_meta
