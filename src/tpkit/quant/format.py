"""What a quantization format family provides: the `Format` each of `compressed_tensors.py`, `fp8.py`, `gptq.py` and
`awq.py` fills in, and the registry (`registry.py`) holds by `quant_method`.

As vLLM's `layers/quantization/` keeps one file per format (a `QuantizationConfig` and the per-layer method it
picks), a format here says four things, and nothing about layers or models (`tpkit.nn.quantized` is the layer side):

- `read(qc)`: its `quantization_config` as a `Quantization` (a `Refused` for anything it does not read);
- `stored_tensors(q, out, in_)`: the tensors a layer of its scheme `q` stores (names, shapes, dtypes, dim rules);
- its dequantization: which stored tensor holds the values, scales, zero points and `g_idx` (`Roles`), how a
  stored tensor unpacks (`values`) and the dtype its `(q - z) * s` is computed in (`math_dtype`);
- `products(...)`: the fast products for a layer's local slice (`Product`s; the layer keeps the fastest measured,
  `products.py`), or none (the layer then multiplies by its dequantized slice).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

from .kernels import aligned
from .schemes import Quantization, StoredTensor, WeightQuant


class Refused(Exception):
    """A format's reader does not read `what` (`why`: the reason, optional); the registry turns it into one
    `QuantizationError` naming everything tpkit reads."""

    def __init__(self, what: str, why: str = ""):
        super().__init__(what)
        self.what, self.why = what, why


@dataclasses.dataclass(frozen=True)
class Roles:
    """Which stored tensor plays which part in `w = (q - z) * s` (`g_idx`: each input column's group, act-order)."""

    values: str
    scale: str
    zero_point: str
    g_idx: str


class Product:
    """A layer's fast product `x W^T` from its stored tensors (by name), in `x`'s dtype. `resident(tensors)` gives,
    once after a load, the tensors the product reads on every call (`products.py`: kept by the layer); here the
    stored ones, starting on a 64-byte boundary (`kernels.aligned`: a view of a file's mapping may not, and torch's
    int8 kernel faults on it). `max_rows`: the most activation rows it is used for (None: any)."""

    name = ""  # what computes it, for reports ("int4": torch's int4 kernel)
    max_rows: int | None = None

    def key(self) -> tuple:
        """What distinguishes it among a layer's candidates (`products.fastest` keeps its choice by these)."""
        return (self.name,)

    def resident(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: aligned(t) for n, t in tensors.items()}

    def __call__(self, x: torch.Tensor, resident: Mapping[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


class Format:
    """One format family (see the module docstring)."""

    method: str = ""     # its `quant_method`
    supported: str = ""  # what tpkit reads of it, for messages and `tpkit.quant.SUPPORTED`

    def read(self, qc: dict) -> Quantization:
        raise NotImplementedError

    def stored_tensors(self, q: WeightQuant, out: int, in_: int) -> list[StoredTensor]:
        raise NotImplementedError

    def roles(self, q: WeightQuant) -> Roles:
        return Roles("weight", q.scale_name, "weight_zero_point", "weight_g_idx")

    def values(self, q: WeightQuant, name: str, t: torch.Tensor) -> torch.Tensor:
        """A stored tensor's values, unpacked (one entry per value along each dim)."""
        return t

    def math_dtype(self, q: WeightQuant, scale_dtype: torch.dtype) -> torch.dtype:
        """The dtype `(q - z) * s` is computed in before the cast to the compute dtype (as the format's own
        library dequantizes)."""
        return scale_dtype

    def products(self, q: WeightQuant, local_shape: tuple[int, int], mapped: bool, dtype: torch.dtype,
                 scale_dtype: torch.dtype | None) -> list[Product]:
        """The fast products that compute a layer of scheme `q` holding `local_shape` (`[out, in]`) in `dtype`
        exactly as its dequantized weight would (to the rounding of the compute dtype); `mapped`: some stored tensor
        needs a `positions` map (a split cut its groups). The layer measures them and keeps the fastest
        (`products.fastest`); none: it multiplies by its dequantized slice."""
        return []
