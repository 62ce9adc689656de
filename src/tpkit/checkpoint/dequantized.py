"""`from_pretrained(dequantize=True)`: a quantized checkpoint read into dense, trainable layers.

The model is built dense (the conversion splits it as it would split the quantized layers: whole groups where it
can, `tpkit.convert.quantized`); each quantized layer's stored tensors are read, this rank's slices only, into a
holder that the layer's quantization method fills as it would fill the layer (`QuantMethod.create_weights`), and
its dense weight is computed from them once (`QuantMethod.weight`: the weight transformers' load holds at that
dtype). The holders are dropped after the load.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..convert.layouts import shard_layouts
from ..convert.quantized import QuantizedLayers
from ..nn.quantized import quant_method_of
from .errors import CheckpointError
from .fill import Target
from .load import Source, check_target


def holders(model: nn.Module, quantized: QuantizedLayers, device: torch.device) -> dict[str, nn.Module]:
    """Per quantized layer, a module holding its stored tensors (empty, this rank's slices, on `device`) and its
    method, for the dense layout the conversion gave its weight. Raises `QuantizationError` for a split the format
    cannot follow."""
    layouts = shard_layouts(model)
    out = {}
    for name in quantized.layers:
        holder = nn.Module()
        quantized.method(name, model.get_submodule(name)).create_weights(holder, layouts[f"{name}.weight"], device,
                                                                         name)
        out[name] = holder
    return out


def targets(source: Source, held: dict[str, nn.Module], find: Callable[[str], str | None]) -> list[Target]:
    """The reads that fill the holders, checked as the model's are (`load.check_target`)."""
    out = []
    for name, holder in held.items():
        method = quant_method_of(holder)
        for s in method.specs:
            key, t = f"{name}.{s}", holder._buffers[s]
            stored = find(key)
            if stored is None:
                raise CheckpointError(f"{source.root}: checkpoint lacks {key}, which its layer {name} stores "
                                      f"({method.describe()})")
            out.append(Target(stored, key, method.layouts[s], t.dtype, t))
            check_target(source, out[-1])
    return out


def fill_weights(model: nn.Module, held: dict[str, nn.Module]) -> None:
    """Each layer's dense weight from its holder's stored tensors."""
    with torch.no_grad():
        for name, holder in held.items():
            model.get_submodule(name).weight.copy_(quant_method_of(holder).weight(holder))
