"""Which part of each stored quantized tensor a rank holds, derived from the dense weight's `ShardLayout`.

The converter plans a quantized linear layer as if it were dense (`[out, in]`, whole heads, packed pieces, the
split rule); each stored tensor then follows the dense split along the dim that runs with it: a packed dim in
whole words (a split must fall on a word boundary), a grouped dim (scales, zero points, FP8 blocks) in the groups
the rank's features touch. A group cut by a split (attention heads narrower than a group) is held by both ranks,
as a KV head two ranks share is: each rank's dequantized weight is still exactly the slice of the full one.
`positions` gives, for each of the rank's dense features, which entry of its local (unpacked) tensor covers it.
"""
from __future__ import annotations

import torch

from ..layout import Piece, ShardLayout
from .schemes import DimRule, QuantizationError, StoredTensor


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def stored_layout(dense: ShardLayout, spec: StoredTensor, where: str) -> ShardLayout:
    """The layout of `spec` (one stored tensor of the layer `where`) that follows the dense weight's `dense`."""
    at = [i for i, r in enumerate(spec.dims) if dense.dim is not None and r.dense == dense.dim]
    if not at or dense.is_replicated:
        return ShardLayout.replicated(spec.shape, dense.world_size, dense.rank)
    i, rule = at[0], spec.dims[at[0]]
    unit, full = rule.unit, dense.full_shape[dense.dim]
    pieces = []
    for p in dense.pieces:
        last = p.offset + p.size == full
        if p.offset % unit or (p.size % unit and not last):
            raise QuantizationError(f"{where}: its packed pieces (widths along dim {dense.dim}) do not start on the "
                                    f"units of {unit} that {spec.name} stores together; load it with dequantize=True")
        spans = []
        for a, b in p.spans:
            if rule.pack > 1 and (a % rule.pack or (b % rule.pack and p.offset + b != full)):
                raise QuantizationError(f"{where}: this rank's features [{p.offset + a}, {p.offset + b}) of dim "
                                        f"{dense.dim} cut the {rule.pack} values packed in one word of {spec.name}; "
                                        f"use a world size whose split keeps multiples of {rule.pack}, or "
                                        f"dequantize=True")
            spans.append((a // unit, _ceil(b, unit)) if b > a else (a // unit, a // unit))
        pieces.append(Piece(p.offset // unit, _ceil(p.size, unit), tuple(spans)))
    return ShardLayout(spec.shape, dense.world_size, dense.rank, i, tuple(pieces))


def positions(dense: ShardLayout, spec: StoredTensor, dim: int) -> torch.Tensor | None:
    """For each of the rank's dense features along the dense dim that `spec`'s `dim` runs with, the index of the
    entry that covers it in the rank's local `spec` tensor after unpacking; None when the features are whole groups
    from the first entry on (entry `k` covers features `k*group .. (k+1)*group - 1`: the identity for group 1), or
    all covered by the first entry."""
    rule: DimRule = spec.dims[dim]
    d = rule.dense
    if d is None:
        return None
    full = dense.full_shape[d]
    split = dense.dim == d and not dense.is_replicated
    segments = dense.segments() if split else [(0, full)]
    out, base = [], 0
    for a, b in segments:
        first = a // rule.unit
        out.extend(base + x // rule.group - first * rule.pack for x in range(a, b))
        base += (_ceil(b, rule.unit) - first) * rule.pack
    if out == [x // rule.group for x in range(len(out))] and len(out) % rule.group == 0 or not any(out):
        return None  # whole groups from the first, or one entry for all (a per-channel scale of a row split's
        #              slice): one entry per group, broadcast (`dequant._apply`)
    return torch.tensor(out, dtype=torch.long)
