"""What one quantized linear layer holds on a rank once loaded: one record the layer is built from and the sizing
tools count from.

A load builds each quantized layer from `layer_tensors` (`tpkit.nn.quantized.QuantMethod.create_weights`): its
stored tensors (specs, this rank's layouts, dtypes), the maps where a split cuts a group (`positions`: int64, one
per local dense feature, kept as non-persistent buffers) and the fast products its format offers for the slice;
once the values are read it keeps the fastest one's `resident` tensors (`after_loading`), a stored tensor itself
where the product reads it in place. `resident_bytes` counts what the layer keeps beyond its stored tensors from
the same record, running the products' own `resident` on meta tensors of the rank's shapes, so `tpkit.analyze` and
`tpkit.estimate_memory` count a load's bytes by the load's rules, not by a second copy of them. The native product
reads every stored tensor in place (`products.Native`), so for the formats read today that count is the maps alone.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

from ..layout import ShardLayout
from .layouts import positions, stored_layout
from .schemes import QuantizationError, StoredTensor, WeightQuant, stored_tensors


@dataclasses.dataclass(frozen=True)
class LayerTensors:
    """A quantized layer's tensors on one rank (see the module docstring): stored `specs`, their `layouts` and
    `dtypes` by stored name, `maps` by (stored name, dim), and the format's `candidates` products for the slice."""

    specs: Mapping[str, StoredTensor]
    layouts: Mapping[str, ShardLayout]
    dtypes: Mapping[str, torch.dtype]
    maps: Mapping[tuple[str, int], torch.Tensor]
    candidates: tuple


def layer_tensors(scheme: WeightQuant, dense: ShardLayout, dtype: torch.dtype,
                  stored_dtypes: Mapping[str, torch.dtype] | None = None, where: str = "") -> LayerTensors:
    """The tensors a layer of `scheme` holds for the dense weight's layout `dense` in compute dtype `dtype`, its
    floating stored tensors (scales) in `stored_dtypes` (default `dtype`). Raises `QuantizationError` (naming
    `where`) for a split the format cannot follow."""
    specs = {s.name: s for s in stored_tensors(scheme, *dense.full_shape)}
    layouts = {n: stored_layout(dense, s, where) for n, s in specs.items()}
    dtypes = {n: s.dtype or (stored_dtypes or {}).get(n, dtype) for n, s in specs.items()}
    maps = {}
    for n, s in specs.items():
        for i in range(len(s.dims)):
            m = positions(dense, s, i)
            if m is not None:
                maps[n, i] = m
    fmt = scheme.format
    candidates = fmt.products(scheme, tuple(dense.local_shape), bool(maps), dtype, dtypes.get(fmt.roles(scheme).scale))
    return LayerTensors(specs, layouts, dtypes, maps, tuple(candidates))


def resident_bytes(scheme: WeightQuant, dense: ShardLayout, dtype: torch.dtype,
                   stored_dtypes: Mapping[str, torch.dtype] | None = None) -> int:
    """Bytes a loaded layer of `scheme` keeps beyond its stored tensors on the rank of `dense` (arguments as
    `layer_tensors`): its maps, and the tables its fast product makes at load; of the candidates (the load keeps
    the one it measures fastest) the most any keeps. 0 for a split the format cannot follow (the load refuses it)."""
    try:
        held = layer_tensors(scheme, dense, dtype, stored_dtypes)
    except QuantizationError:
        return 0
    maps = sum(m.numel() * m.element_size() for m in held.maps.values())
    stored = {n: torch.empty(held.layouts[n].local_shape, dtype=held.dtypes[n], device="meta") for n in held.specs}
    return maps + max((_made(p.resident(stored), stored) for p in held.candidates), default=0)


def _made(resident: Mapping[str, torch.Tensor], stored: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a product's resident tensors that are not the stored tensors themselves (one under a stored name
    replaces that tensor: `after_loading`)."""
    return sum(t.numel() * t.element_size() for key, t in resident.items()
               if key not in stored and not any(t is s for s in stored.values()))
