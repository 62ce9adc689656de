"""The dense `[out, in]` weight of a quantized layer (a rank's part of it), from its stored tensors.

`w = (q - z) * s` in the scale's dtype, then cast to the compute dtype, as compressed-tensors dequantizes (and
GPTQ / AWQ with their zero points: GPTQ's v1 format stores `z - 1`); Hugging Face FP8 `w = q * s` in float32, then
cast (transformers' `Fp8Dequantize`). Either way the weight is the one transformers' load of the directory holds,
at any compute dtype: a bf16 checkpoint's scales make a bf16-rounded weight even when the layer computes in float32. Scales and zero points reach every feature through the `positions` maps
(`layouts.py`), or through `g_idx` under act-order, so a group cut by a split costs nothing special.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .packing import AWQ_UNPACK_ORDER, unpack_bits, unpack_signed
from .schemes import StoredTensor, WeightQuant

Maps = Mapping[tuple[str, int], "torch.Tensor | None"]


def _values(q: WeightQuant, name: str, t: torch.Tensor) -> torch.Tensor:
    """A stored tensor's values, unpacked (one entry per value along each dim)."""
    if q.layout == "ct_pack" and name == "weight_packed":
        return unpack_signed(t, q.bits, 1)
    if q.layout == "ct_pack" and name == "weight_zero_point":
        return unpack_signed(t, q.bits, 0)
    if q.layout == "gptq" and name == "qweight":
        return unpack_bits(t, q.bits, 0)
    if q.layout == "gptq" and name == "qzeros":
        return unpack_bits(t, q.bits, 1) + 1  # GPTQ v1 stores zero points minus one
    if q.layout == "awq" and name in ("qweight", "qzeros"):
        return unpack_bits(t, q.bits, 1, AWQ_UNPACK_ORDER)
    return t


def _grid(spec: StoredTensor, values: torch.Tensor, maps: Maps, shape: tuple[int, int]) -> torch.Tensor:
    """`values` brought onto the rank's dense features, `[out, in]`-oriented: a dim with a `positions` map is
    indexed by it; a grouped dim without one holds whole aligned groups and keeps one entry per group (`_apply`
    broadcasts it); a packed dim loses the padding of its last word; a whole or `g_idx` dim is kept."""
    for i, rule in enumerate(spec.dims):
        if rule.dense is None:
            continue
        m = maps.get((spec.name, i))
        if m is not None:
            values = values.index_select(i, m)
        elif rule.group == 1 and values.shape[i] != shape[rule.dense]:
            values = values.narrow(i, 0, shape[rule.dense])  # the padding of a last packed word
    return values.t() if values.dim() == 2 and spec.dims[1].dense == 0 else values


def _apply(v: torch.Tensor, t: torch.Tensor, op) -> torch.Tensor:
    """`op(v, t)` for `v` `[O, I]` and `t` `[o, i]` whose entries each cover an `O/o x I/i` block of `v` (one
    per element, per aligned group or block, or one for all), without expanding `t`."""
    if t.dim() < 2:
        return op(v, t)
    (O, I), (o, i) = v.shape, t.shape
    return op(v.view(o, O // o, i, I // i), t.view(o, 1, i, 1)).view(O, I)


def dequantize(q: WeightQuant, specs: Mapping[str, StoredTensor], tensors: Mapping[str, torch.Tensor], maps: Maps,
               shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The rank's dense weight (`shape` = its local `[out, in]`) in `dtype`."""
    names = {"ct_pack": "weight_packed", "gptq": "qweight", "awq": "qweight"}
    wname = names.get(q.layout, "weight")
    sname = "scales" if q.layout in ("gptq", "awq") else q.scale_name
    zname = "qzeros" if q.layout in ("gptq", "awq") else "weight_zero_point"
    gname = "g_idx" if q.layout == "gptq" else "weight_g_idx"
    w = _grid(specs[wname], _values(q, wname, tensors[wname]), maps, shape)
    scale = tensors[sname]
    math_dtype = torch.float32 if q.method == "fp8" else scale.dtype
    s = _grid(specs[sname], scale, maps, shape).to(math_dtype)
    z = _grid(specs[zname], _values(q, zname, tensors[zname]), maps, shape) if zname in tensors else None
    if q.act_order:  # scales and zero points whole along the groups; each column reads its own group
        g = tensors[gname].long()
        s = s.index_select(1, g)
        z = None if z is None else z.index_select(1, g)
    v = w.to(math_dtype)
    if z is not None:
        v = _apply(v, z.to(math_dtype), torch.sub)
    return _apply(v, s, torch.mul).to(dtype)
