"""`DecodeLinear`: an `nn.Linear` whose product at a decode's few rows is the faster of `F.linear` and tpkit's own.

A split layer's shard (`ColumnParallelLinear`, `RowParallelLinear`) multiplies a dense bf16 / fp16 / float32 weight
at up to 8 activation rows through `tpkit.quant.products.dense_linear`: the faster of torch's `F.linear` and tpkit's
compiled product, measured per shape. A layer a conversion keeps whole (every layer at world size 1, a quantized
checkpoint's dense LM head included; one the plan keeps replicated, at any) stayed a plain `nn.Linear` and ran torch's
product alone. At world size 1 a bf16 Llama (hidden 2048, 8 layers, one 2-core EPYC process) decoded at 55 ms/token
through torch's product and at 26 ms through the faster one. Both layers compute through `products.faster_linear`.

At world size 1 `parallelize` gives every plain `nn.Linear` in the model this class (`adopt_decode_products`, through
`tpkit.nn.decode.adopt_decode_paths`), in place. On several ranks a Linear kept whole is a replica on each, and stays
torch's: the choice is timed on each rank apart, and replicas must round alike. The adopted layer:
the object stays (its hooks, its parameters, its state-dict keys), `isinstance(m, nn.Linear)` holds (stock tools and
PEFT see a Linear), and outside a decode (a gradient asked for, autocast, more rows, a GPU) the forward is exactly
`F.linear`. A class change, as `torch.nn.utils.parametrize` makes one, made where tpkit makes them all
(`rewrites.adopt`: a Linear tpkit rewrote, a gradient summed over ranks, keeps its rewrites).
"""
from __future__ import annotations

import torch
from torch import nn

from ..quant.products import faster_linear
from .rewrites import adopt, base_class


class DecodeLinear(nn.Linear):
    """`nn.Linear` with a decode's product (see the module docstring); built by `adopt_decode_products`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return faster_linear(input, self.weight, self.bias)


def adopt_decode_products(model: nn.Module) -> list[str]:
    """Every module of `model` whose class (before tpkit's rewrites) is exactly `nn.Linear` made a `DecodeLinear`, in
    place (a subclass, with its own forward, is left as it is); returns their names. The one rule the conversion and
    the speed estimate (`tpkit.estimate.fake_step`) both apply."""
    names = []
    for name, module in model.named_modules():
        if base_class(module) is nn.Linear:
            adopt(module, DecodeLinear)
            names.append(name)
    return names


__all__ = ["DecodeLinear", "adopt_decode_products"]
