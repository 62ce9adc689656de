"""Quantized linear layers: the quantization method of a layer, chosen when the layer is built.

A `QuantMethod` (vLLM's per-layer `LinearMethod`) is how one linear layer stores and computes its weight in a
checkpoint's format (`tpkit.quant`): `create_weights(layer, dense, device)` registers on the layer, under their
stored names, the tensors the format stores in place of `weight` (packed integers or FP8 values, scales, zero
points, `g_idx`), each holding this rank's slice (`tpkit.quant.stored_layout` of the dense weight's layout `dense`),
so the state dict keeps the format's keys and a save keeps the format; `apply(layer, x, bias)` is the layer's
product: on a GPU for a decode's few rows, a fused compiled kernel (`tpkit.quant.fused`) where it measured faster;
on the CPU, the format's fast product where one applies to the local slice (`Format.products`: tpkit's native
product, torch's weight-only CPU kernels); where the input needs a gradient (the kernels have none) or none applies,
`F.linear` of the dequantized slice. No
dense copy is held: reading `layer.weight` dequantizes this rank's slice in the compute dtype, through the one
rewrite protocol (`rewrites.py`: the method is the `weight`'s rewrite, `in_forward_only = False`). The weight is
frozen (buffers): gradients reach the input and the bias, as for a quantized base under an adapter; the dense
weight's gradient sum (rows several ranks hold) is kept as `weight_sum`, for an adapter whose rows follow it
(`tpkit.nn.lora`).

The layers take their method when they are built: `ColumnParallelLinear` / `RowParallelLinear` (`quant_method=`,
their `matmul` calls it) and, for a layer every rank holds whole (world size 1, a layer a plan keeps whole),
`QuantizedLinear` in place of the `nn.Linear`. `quant_method_of(layer)` is the one way to ask a layer for it.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..layout import Piece, ShardLayout
from ..quant import WeightQuant, dequantize, fused, layer_tensors
from ..quant.products import fastest
from .grad_sums import GradSum, rows_sum
from .rewrites import Rewrite, rewrite

_MAP = "tp_qmap_{}_{}"  # a non-persistent buffer: for each local dense feature, the stored entry that covers it
_KEPT = "tp_kernel_"  # non-persistent buffers: what the layer's fast product reads on every call


class StoredWeight(Rewrite):
    """What a quantized parameter's rewrite knows of its stored tensors, for a linear layer's weight
    (`QuantMethod`) and a stack of experts' (`quantized_experts.ExpertsQuantMethod`): the scheme, the compute
    dtype, the file dtypes of its floating stored tensors (scales; default `dtype`), and what `create_weights`
    fills in (the stored tensors' specs and layouts, the dense layout, the maps)."""

    in_forward_only = False  # every read of the parameter is the dequantized slice

    def __init__(self, scheme: WeightQuant, dtype: torch.dtype, stored_dtypes: Mapping[str, torch.dtype] = None):
        self.scheme, self.dtype, self.format = scheme, dtype, scheme.format
        self.stored_dtypes = dict(stored_dtypes or {})
        self.specs: dict = {}
        self.layouts: dict[str, ShardLayout] = {}
        self.dense: ShardLayout | None = None
        self.maps: tuple[tuple[str, int], ...] = ()


class QuantMethod(StoredWeight):
    """How one linear layer stores and computes its weight (see the module docstring). Built with the layer's
    scheme, its compute dtype and the file dtypes of its floating stored tensors (scales; default `dtype`); filled
    in by `create_weights`."""

    def __init__(self, scheme: WeightQuant, dtype: torch.dtype, stored_dtypes: Mapping[str, torch.dtype] = None):
        super().__init__(scheme, dtype, stored_dtypes)
        self.product = None
        self.weight_sum: GradSum | None = None

    @property
    def kernel(self) -> str | None:
        """What computes the product where the input needs no gradient: the fast product's name, or None (the
        dequantized slice)."""
        return None if self.product is None else self.product.name

    @property
    def shape(self) -> tuple[int, int]:
        """The layer's local dense `[out, in]`."""
        return tuple(self.dense.local_shape)

    def create_weights(self, layer: nn.Module, dense: ShardLayout, device, where: str = "") -> dict[str, ShardLayout]:
        """Register the stored tensors on `layer` (empty, at this rank's local shapes, on `device`, meta included)
        for the dense weight's layout `dense`, and this method as its `weight`; returns their layouts by stored name.
        `where`: the layer's name, for messages. Checks everything first."""
        if "weight" in layer._parameters or dense.transposed or len(dense.full_shape) != 2:
            raise TypeError(f"{where or type(layer).__name__}: a quantized layer is built without a dense weight "
                            f"Parameter and with an [out, in] dense layout")
        held = layer_tensors(self.scheme, dense, self.dtype, self.stored_dtypes, where)  # raises before any change
        device = torch.device(device if device is not None else "meta")
        for n in held.specs:
            layer.register_buffer(n, torch.empty(held.layouts[n].local_shape, dtype=held.dtypes[n], device=device))
        for (n, i), m in held.maps.items():
            layer.register_buffer(_MAP.format(n, i), m.to(device if device.type != "meta" else "cpu"),
                                  persistent=False)
        self.specs, self.layouts, self.dense, self.maps = dict(held.specs), dict(held.layouts), dense, tuple(held.maps)
        self.candidates = list(held.candidates)
        self.product, self.resident = None, ()
        self.weight_sum = rows_sum(dense) if dense.dim == 0 else None
        layer.quant_method = self
        rewrite(layer, "weight", self)
        layer.register_load_state_dict_post_hook(self._loaded)  # new stored values: the product's tensors anew
        return self.layouts

    # ------------------------------------------------------------------------------------------------ reading
    def read(self, module: nn.Module, name: str, stored: torch.Tensor | None) -> torch.Tensor:
        return self.weight(module)

    def weight(self, layer: nn.Module) -> torch.Tensor:
        """The layer's dense local weight `[out, in]` in the compute dtype, dequantized from its stored tensors."""
        b = layer._buffers
        tensors = {n: b[n] for n in self.specs}
        maps = {key: b[_MAP.format(*key)] for key in self.maps}
        return dequantize(self.scheme, self.specs, tensors, maps, self.shape, self.dtype, self.format)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x W^T + bias` with the layer's local weight (see the module docstring for the path taken)."""
        p = self.product
        grad = torch.is_grad_enabled() and x.requires_grad
        if not grad and fused.wanted(x):  # (a CPU call pays one comparison: nothing here computes a shape)
            b = layer._buffers
            y = fused.linear(x, self.scheme, self.specs, {n: b[n] for n in self.specs},
                             {key: b[_MAP.format(*key)] for key in self.maps}, self.shape, self.dtype, self.format)
            if y is not None:
                return y if bias is None else y + bias
        if p is None or x.device.type != "cpu" or grad or \
                (p.max_rows is not None and x.numel() > p.max_rows * x.shape[-1]):
            return F.linear(x, self.weight(layer), bias)
        b = layer._buffers
        y = p(x, {key: b[name] for key, name in self.resident})
        return y if bias is None else y + bias

    def after_loading(self, layer: nn.Module) -> None:
        """Once the stored tensors hold their values: pick the fastest product measured on this layer's shape
        (`tpkit.quant.products.fastest`) and keep the tensors it reads on every call: a stored tensor itself where
        the product reads it in place (or in its place, the same values on a 64-byte boundary), else a
        non-persistent buffer (`tp_kernel_*`: only a table the product makes, counted by the sizing tools through
        `tpkit.quant.resident_bytes`)."""
        b = layer._buffers
        for n in [n for n in b if n.startswith(_KEPT)]:
            del b[n]
            layer._non_persistent_buffers_set.discard(n)
        stored = {n: b[n] for n in self.specs}
        on_cpu = all(t.device.type == "cpu" for t in stored.values())  # the candidates are CPU products: measured
        # on device tensors, the native one read GPU addresses from the host (a segfault loading int8 onto cuda)
        self.product = fastest(self.candidates, stored, self.shape[1], self.dtype) if on_cpu else None
        resident = self.product.resident(stored) if self.product is not None else {}
        kept = []
        for key, t in resident.items():
            same = next((n for n, s in stored.items() if s is t), None)
            if key in self.specs:
                b[key] = t  # the same values (on a 64-byte boundary)
                kept.append((key, key))
            elif same is not None:
                kept.append((key, same))
            else:
                layer.register_buffer(_KEPT + key, t, persistent=False)
                kept.append((key, _KEPT + key))
        self.resident = tuple(kept)

    def _loaded(self, layer: nn.Module, incompatible) -> None:
        self.after_loading(layer)

    def describe(self) -> str:
        return self.scheme.describe()


def quant_method_of(layer: nn.Module) -> QuantMethod | None:
    """The quantization method `layer` itself was built with (not one a wrapper forwards to: PEFT's LoRA layers
    forward attributes to their base), or None for a dense layer."""
    method = layer.__dict__.get("quant_method")
    return method if isinstance(method, QuantMethod) else None


def plain_layout(full: tuple[int, int], dim: int, sizes: tuple[int, ...], rank: int) -> ShardLayout:
    """The layout of a weight `full` split along `dim` into consecutive `sizes` per rank (the split rule's)."""
    spans, start = [], 0
    for n in sizes:
        spans.append((start, start + n))
        start += n
    return ShardLayout(tuple(full), len(sizes), rank, dim, (Piece(0, full[dim], tuple(spans)),))


class QuantizedLinear(nn.Linear):
    """A linear layer every rank holds whole (world size 1, or a layer the plan keeps whole) whose weight is stored
    quantized: the `nn.Linear` it replaces, with the format's stored tensors in place of `weight` (same state-dict
    keys as the checkpoint) and `quant_method` computing its product."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant_method: QuantMethod,
                 dense: ShardLayout | None = None, device=None, dtype: torch.dtype | None = None, where: str = ""):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features, device=device, dtype=dtype or
                                                                 quant_method.dtype)) if bias else None)
        dense = dense or ShardLayout.replicated((out_features, in_features), 1, 0)
        quant_method.create_weights(self, dense, device, where)

    @classmethod
    def from_module(cls, module: nn.Linear, quant_method: QuantMethod, dense: ShardLayout | None = None,
                    where: str = "") -> "QuantizedLinear":
        """The quantized layer in place of `module` (its bias Parameter kept: values, device, dtype), the stored
        tensors empty on `module`'s device (a load fills them)."""
        new = cls(module.in_features, module.out_features, False, quant_method, dense, module.weight.device,
                  where=where)
        if module.bias is not None:
            new.bias = module.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


def finish_loading(model: nn.Module) -> None:
    """After a load filled the stored tensors: each quantized layer of `model` keeps them as its product reads them
    (`QuantMethod.after_loading`)."""
    for m in model.modules():
        method = quant_method_of(m)
        if method is not None:
            method.after_loading(m)
