"""The decode fast paths a conversion gives a model, as one rule: every place that builds a model to run it (the
swap step of `parallelize`, a tp-1 setup, a tp-1 pipeline stage) or to price it (the speed estimate's copies, the
framework fit's one-rank model) applies this, so the estimate prices what the runtime runs."""
from __future__ import annotations

from torch import nn

from .decode_attention import adopt_decode_attention
from .decode_linear import adopt_decode_products


def adopt_decode_paths(model: nn.Module, ranks: int = 1) -> list[str]:
    """Every attention layer of `model` that dispatches on transformers' `AttentionInterface` marked for a
    half-precision decode step in float32 (`decode_attention.py`: decided by shapes and dtypes alone), and, on one
    rank, every plain `nn.Linear` made a `DecodeLinear` (`decode_linear.py`); in place. Returns the names changed.

    A Linear kept whole on `ranks` > 1 ranks (a router, a gate: a replica on each) stays torch's: a `DecodeLinear`
    times its product choice on each rank apart, and two ranks choosing differently would round their replicas'
    outputs differently, so the ranks' hidden states, and a router's top-k at a near tie, could part."""
    products = adopt_decode_products(model) if ranks == 1 else []
    return products + adopt_decode_attention(model)


__all__ = ["adopt_decode_paths"]
