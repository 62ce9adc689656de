"""Quantized linear layers: a linear layer (whole, column- or row-parallel) whose weight is stored packed.

`quantize_linear(layer, scheme, dense_layout, dtype)` replaces the layer's `weight` Parameter by the tensors
its checkpoint format stores (`tpkit.quant.stored_tensors`: packed integers or FP8 values, scales, zero points,
`g_idx`) as buffers under their stored names, each holding this rank's slice (`tpkit.quant.stored_layout` of the
dense weight's layout), so the state dict keeps the format's keys and a save keeps the format. No dense copy is
held: reading `layer.weight` dequantizes this rank's slice in the compute dtype, and the layer's product
(`matmul`, inside its own forward and communication) is torch's weight-only CPU kernel where one maps onto the
format (`tpkit.quant.kernels`), else `F.linear` of that dequantized slice. The weight is frozen (a buffer): gradients reach the input and the
bias, as for a quantized base under an adapter.

The layer's class becomes a subclass made once per class (the `weight` property), with the base's behaviour
otherwise; `isinstance(layer, ColumnParallelLinear)` still holds.
"""
from __future__ import annotations

import dataclasses
import threading

import torch
import torch.nn.functional as F
from torch import nn

from ..layout import ShardLayout
from .grad_sums import GradSum, sum_of
from .rewrites import remove_rewrite
from ..quant import StoredTensor, WeightQuant, dequantize, positions, stored_layout, stored_tensors
from ..quant.kernels import int4_linear, int8_linear, kernel_for
from ..quant.packing import unpack_signed

_MAP = "tp_qmap_{}_{}"


@dataclasses.dataclass(frozen=True)
class QuantState:
    """What a quantized layer needs besides its tensors: the scheme, its stored tensors' specs (full shapes), the
    dense weight's layout (`shape`: its local `[out, in]`) and the compute dtype."""

    scheme: WeightQuant
    specs: dict[str, StoredTensor]
    dense: ShardLayout
    dtype: torch.dtype
    kernel: str | None = None  # "int4" / "int8": torch's CPU kernel computes the product (`tpkit.quant.kernels`)
    weight_sum: GradSum | None = None  # the dense weight's gradient sum (rows several ranks hold): a frozen weight
    #                                    needs none, an adapter whose rows follow it does (`tpkit.nn.lora`)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.dense.local_shape)


def _weight(self) -> torch.Tensor:
    st: QuantState = self.__dict__["tp_quant"]
    b = self._buffers
    tensors = {n: b[n] for n in st.specs}
    maps = {(n, i): b.get(_MAP.format(n, i)) for n, s in st.specs.items() for i in range(len(s.dims))}
    return dequantize(st.scheme, st.specs, tensors, maps, st.shape, st.dtype)


def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's product: torch's weight-only CPU kernel where one maps onto the stored format and no gradient
    is asked of the input (the kernels have no backward), else the dequantized slice through `F.linear`."""
    st: QuantState = self.__dict__["tp_quant"]
    if st.kernel is None or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, self.weight, bias)
    b = self._buffers
    if st.kernel == "int4":
        y = int4_linear(x, b["weight_packed"], b["weight_scale"], _signed_zero_point(st, b), st.scheme.group_size)
    else:
        y = int8_linear(x, b[_weight_name(st.scheme)], b["weight_scale"])
    return y if bias is None else y + bias


def _weight_name(q: WeightQuant) -> str:
    return "weight_packed" if q.layout == "ct_pack" else "weight"


def _signed_zero_point(st: QuantState, b) -> torch.Tensor | None:
    z = b.get("weight_zero_point")
    return None if z is None else unpack_signed(z, st.scheme.bits, 0)


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.matmul(x, self.bias)


_LOCK = threading.Lock()
_CLASSES: dict[type, type] = {}


def _rebuild(base: type) -> nn.Module:
    return object.__new__(quantized_class(base))


def _reduce_ex(self, protocol):
    return _rebuild, (self.__dict__["tp_quant_base"],), self.__getstate__()


def quantized_class(base: type) -> type:
    """The subclass of `base` whose `weight` is dequantized from its stored tensors (one per base, kept)."""
    with _LOCK:
        cls = _CLASSES.get(base)
        if cls is None:
            body = {"weight": property(_weight), "matmul": _matmul, "__module__": base.__module__,
                    "__reduce_ex__": _reduce_ex, "__qualname__": "Quantized" + base.__qualname__,
                    "__doc__": base.__doc__}
            if not hasattr(base, "matmul"):  # nn.Linear: its forward is the product
                body["forward"] = _forward
            cls = _CLASSES[base] = type("Quantized" + base.__name__, (base,), body)
        return cls


def quant_state(module: nn.Module) -> QuantState | None:
    return module.__dict__.get("tp_quant")


def quantize_linear(layer: nn.Module, scheme: WeightQuant, dense: ShardLayout, dtype: torch.dtype,
                    stored_dtypes: dict[str, torch.dtype], where: str) -> dict[str, ShardLayout]:
    """Replace `layer.weight` (a Parameter of the dense layout `dense`, on any device, meta included) by the
    scheme's stored tensors, empty, at this rank's local shapes, on its device; returns their layouts by name.
    `stored_dtypes`: the file's dtype of each stored floating tensor (scales). Checks everything first."""
    w = layer._parameters.get("weight")
    if w is None or dense.transposed or len(dense.full_shape) != 2:
        raise TypeError(f"{where}: quantize_linear needs a linear layer holding a [out, in] weight Parameter")
    out, in_ = dense.full_shape
    specs = {s.name: s for s in stored_tensors(scheme, out, in_)}
    layouts = {n: stored_layout(dense, s, where) for n, s in specs.items()}  # raises before anything changes
    device = w.device
    del layer._parameters["weight"]
    mapped, dtypes = False, {n: s.dtype or stored_dtypes.get(n, dtype) for n, s in specs.items()}
    for n, s in specs.items():
        layer.register_buffer(n, torch.empty(layouts[n].local_shape, dtype=dtypes[n], device=device))
        for i in range(len(s.dims)):
            m = positions(dense, s, i)
            if m is not None:
                mapped = True
                layer.register_buffer(_MAP.format(n, i), m.to(device if device.type != "meta" else "cpu"),
                                      persistent=False)
    weight_sum = sum_of(layer, "weight")  # a frozen weight has no gradient to sum (an adapter on it may)
    if weight_sum is not None:
        remove_rewrite(layer, "weight")
    base = type(layer)
    layer.__dict__["tp_quant_base"] = base
    layer.__dict__["tp_quant"] = QuantState(scheme, specs, dense, dtype,
                                            kernel_for(scheme, tuple(dense.local_shape), mapped, dtype,
                                                       dtypes.get(scheme.scale_name)), weight_sum)
    layer.__class__ = quantized_class(base)
    return layouts


def dequantize_layer(layer: nn.Module) -> None:
    """Turn a quantized layer back into its dense class, its `weight` the dequantized local slice (a Parameter);
    the stored tensors are dropped."""
    weight = layer.weight
    st: QuantState = layer.__dict__.pop("tp_quant")
    layer.__class__ = layer.__dict__.pop("tp_quant_base")
    for n, s in st.specs.items():
        del layer._buffers[n]
        for i in range(len(s.dims)):
            layer._buffers.pop(_MAP.format(n, i), None)
            layer._non_persistent_buffers_set.discard(_MAP.format(n, i))
    layer.register_parameter("weight", nn.Parameter(weight.detach(), requires_grad=False))
