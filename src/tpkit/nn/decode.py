"""The decode fast paths a conversion gives a model, as one rule: every place that builds a model to run it (the
swap step of `parallelize`, a tp-1 setup, a tp-1 pipeline stage) or to price it (the speed estimate's copies, the
framework fit's one-rank model) applies this, so the estimate prices what the runtime runs."""
from __future__ import annotations

from torch import nn

from .decode_attention import adopt_decode_attention
from .decode_linear import adopt_decode_products


def adopt_decode_paths(model: nn.Module) -> list[str]:
    """Every plain `nn.Linear` of `model` made a `DecodeLinear` (`decode_linear.py`), every attention layer that
    dispatches on transformers' `AttentionInterface` marked for a half-precision decode step in float32
    (`decode_attention.py`); in place. Returns the names of the modules changed."""
    return adopt_decode_products(model) + adopt_decode_attention(model)


__all__ = ["adopt_decode_paths"]
