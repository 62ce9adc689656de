"""Module-type predicates: a per-token feature norm is recognised by type and behaviour, not by its name."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tpkit.convert.modules import is_feature_norm


class ScaleNorm(nn.Module):
    """Named like a norm, but only scales each feature: not a norm."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.full((hidden,), 2.0))

    def forward(self, x):
        return x * self.weight


class MyRMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class SequenceNorm(MyRMSNorm):
    """Normalises over the sequence (dim -2): mixes tokens."""

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + self.eps)


@pytest.mark.parametrize("module,expected", [
    (nn.LayerNorm(8), True), (nn.RMSNorm(8), True), (MyRMSNorm(8), True), (nn.LayerNorm((4, 8)), False),
    (nn.GroupNorm(2, 8), False), (nn.BatchNorm1d(8), False), (nn.InstanceNorm1d(8, affine=True), False),
    (ScaleNorm(8), False), (SequenceNorm(8), False), (nn.Linear(8, 8), False),
])
def test_feature_norm_by_type_and_behaviour(module, expected):
    assert is_feature_norm(module) is expected


def test_hf_rms_norms_on_cpu_and_meta():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    for cls in (LlamaRMSNorm, T5LayerNorm):
        assert is_feature_norm(cls(16))
        with torch.device("meta"):
            assert is_feature_norm(cls(16))
