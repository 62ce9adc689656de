"""`from_pretrained(dequantize=True)`: a quantized checkpoint read into dense, trainable layers.

The model is built dense (the conversion splits it as it would split the quantized layers: whole groups where it
can, `tpkit.convert.quantized`); each quantized tensor's stored slices are read, this rank's only, into a holder
that the layer's quantization method fills as it would fill the layer (`QuantMethod.create_weights`, or
`ExpertsQuantMethod.create_weights` for a MoE layer's stacked experts), and the dense tensor is computed from them
once (the weight transformers' load holds at that dtype). The holders are dropped after the load.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from ..convert.layouts import shard_layouts
from ..convert.quantized import QuantizedLayers
from ..nn.quantized import quant_method_of
from ..nn.quantized_experts import experts_methods_of
from .errors import CheckpointError
from .fill import Target
from .load import Source, check_target


def holders(model: nn.Module, quantized: QuantizedLayers, device: torch.device) -> dict[str, nn.Module]:
    """Per dense tensor the checkpoint stores quantized (its model key), a module holding its stored tensors (empty,
    this rank's slices, on `device`) and their method, for the dense layout the conversion gave it. Raises
    `QuantizationError` for a split the format cannot follow."""
    layouts = shard_layouts(model)
    out = {}
    for name in quantized.names():
        method = quantized.method(name, model.get_submodule(name))
        if isinstance(method, dict):  # fused experts: one holder per stacked parameter
            for param, stacked in method.items():
                holder = nn.Module()
                holder.register_parameter(param, nn.Parameter(torch.empty(0, device="meta"), requires_grad=False))
                stacked.create_weights(holder, param, layouts[f"{name}.{param}"], device, name)
                out[f"{name}.{param}"] = holder
        else:
            holder = nn.Module()
            method.create_weights(holder, layouts[f"{name}.weight"], device, name)
            out[f"{name}.weight"] = holder
    return out


def _stored(key: str, holder: nn.Module) -> Iterator[tuple[str, torch.Tensor, object]]:
    """(model key, holder tensor, its layout) of each stored tensor behind dense tensor `key`."""
    method = quant_method_of(holder)
    if method is not None:
        head = key.rpartition(".")[0]
        for s in method.specs:
            yield f"{head}.{s}", holder._buffers[s], method.layouts[s]
        return
    for param, stacked in experts_methods_of(holder).items():
        for s in stacked.specs:
            yield f"{key}.{s}", holder._modules[param]._buffers[s], stacked.layouts[s]


def targets(source: Source, held: dict[str, nn.Module], find: Callable[[str], str | None]) -> list[Target]:
    """The reads that fill the holders, checked as the model's are (`load.check_target`)."""
    out = []
    for key, holder in held.items():
        for name, t, layout in _stored(key, holder):
            stored = find(name)
            if stored is None:
                raise CheckpointError(f"{source.root}: checkpoint lacks {name}, which {key} is stored as")
            out.append(Target(stored, name, layout, t.dtype, t))
            check_target(source, out[-1])
    return out


def dense_keys(held: dict[str, nn.Module]) -> Iterator[tuple[str, nn.Module]]:
    """(model key, holder) of each dense tensor computed from stored tensors."""
    return iter(held.items())


def fill_weights(model: nn.Module, held: dict[str, nn.Module]) -> None:
    """Each dense tensor from its holder's stored tensors."""
    with torch.no_grad():
        for key, holder in held.items():
            head, _, leaf = key.rpartition(".")
            method = quant_method_of(holder)
            dense = method.weight(holder) if method is not None else getattr(holder, leaf)
            getattr(model.get_submodule(head), leaf).copy_(dense)
