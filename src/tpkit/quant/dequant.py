"""The dense `[out, in]` weight of a quantized layer (a rank's part of it), from its stored tensors: one function for
every format, which says which tensor is what (`Format.roles`), how it unpacks (`Format.values`) and the dtype of
the arithmetic (`Format.math_dtype`).

`w = (q - z) * s` in the scale's dtype, then cast to the compute dtype, as compressed-tensors dequantizes (and
GPTQ / AWQ with their zero points); Hugging Face FP8 `w = q * s` in float32, then cast (transformers'
`Fp8Dequantize`). Either way the weight is the one transformers' load of the directory holds,
at any compute dtype: a bf16 checkpoint's scales make a bf16-rounded weight even when the layer computes in float32. Scales and zero points reach every feature through the `positions` maps
(`layouts.py`), or through `g_idx` under act-order, so a group cut by a split costs nothing special.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .format import Format
from .schemes import StoredTensor, WeightQuant

Maps = Mapping[tuple[str, int], "torch.Tensor | None"]


def on_grid(spec: StoredTensor, values: torch.Tensor, maps: Maps, shape: tuple[int, int]) -> torch.Tensor:
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
               shape: tuple[int, int], dtype: torch.dtype, fmt: Format | None = None) -> torch.Tensor:
    """The rank's dense weight (`shape` = its local `[out, in]`) in `dtype`; `fmt`: `q`'s format (`q.format`, looked
    up once by a caller on a hot path)."""
    fmt = fmt or q.format
    r = fmt.roles(q)
    w = on_grid(specs[r.values], fmt.values(q, r.values, tensors[r.values]), maps, shape)
    scale = tensors[r.scale]
    math_dtype = fmt.math_dtype(q, scale.dtype)
    s = on_grid(specs[r.scale], scale, maps, shape).to(math_dtype)
    z = on_grid(specs[r.zero_point], fmt.values(q, r.zero_point, tensors[r.zero_point]), maps, shape) \
        if r.zero_point in tensors else None
    if q.act_order:  # scales and zero points whole along the groups; each column reads its own group
        g = tensors[r.g_idx].long()
        s = s.index_select(1, g)
        z = None if z is None else z.index_select(1, g)
    v = w.to(math_dtype)
    if z is not None:
        v = _apply(v, z.to(math_dtype), torch.sub)
    return _apply(v, s, torch.mul).to(dtype)
