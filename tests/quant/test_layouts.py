"""Stored tensors follow any split of the dense weight, including splits that cut groups and FP8 blocks.

For random shapes, groups and world sizes, the dense `[out, in]` weight is split along either dim by the split rule
in whole packed words (uneven where it does not divide); each rank's stored slices (`stored_layout`) dequantize
(`dequantize` with the `positions` maps) to exactly the slice of the full weight, computed here in plain torch
from the format's definition.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkit.layout import Piece, ShardLayout
from tpkit.quant import QuantizationError, WeightQuant, dequantize, positions, stored_layout, stored_tensors
from tpkit.quant.schemes import DimRule, StoredTensor

pytest.importorskip("compressed_tensors")


def _dense_layout(shape, dim, world, rank, unit) -> ShardLayout:
    return ShardLayout(tuple(shape), world, rank, dim, (Piece.split(0, shape[dim], world, unit),))


@settings(max_examples=40, deadline=None)
@given(out8=st.integers(1, 12), groups=st.integers(1, 6), group=st.sampled_from([8, 16, 32]),
       world=st.integers(1, 5), dim=st.integers(0, 1), asym=st.booleans(), seed=st.integers(0, 10 ** 6))
def test_int4_group_slices_dequantize_to_the_dense_slice(out8, groups, group, world, dim, asym, seed):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out, in_ = 8 * out8, groups * group
    if (out if dim == 0 else in_) // 8 < world:
        return
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (out, in_), generator=g, dtype=torch.int8)
    z = torch.randint(-8, 8, (out, groups), generator=g, dtype=torch.int8) if asym else torch.zeros(out, groups,
                                                                                                   dtype=torch.int8)
    s = torch.rand(out, groups, generator=g) + 0.01
    full = (q.float() - z.float().repeat_interleave(group, 1)) * s.repeat_interleave(group, 1)
    stored = {"weight_packed": pack_to_int32(q, 4), "weight_scale": s, "weight_shape": torch.tensor([out, in_])}
    if asym:
        stored["weight_zero_point"] = pack_to_int32(z, 4, packed_dim=0)
    scheme = WeightQuant("compressed-tensors", "ct_pack", 4, not asym, "group", group_size=group)
    specs = {t.name: t for t in stored_tensors(scheme, out, in_)}
    assert set(specs) == set(stored)
    for rank in range(world):
        dense = _dense_layout((out, in_), dim, world, rank, 8)
        local = {n: stored_layout(dense, specs[n], "layer").shard(t) for n, t in stored.items()}
        maps = {(n, i): positions(dense, specs[n], i) for n in specs for i in range(len(specs[n].dims))}
        got = dequantize(scheme, specs, local, maps, dense.local_shape, torch.float32)
        assert torch.equal(got, dense.shard(full))


def test_fp8_blocks_cut_by_a_split_are_held_by_both_ranks():
    spec = StoredTensor("weight_scale", (3, 2), None, (DimRule(0, 1, 128), DimRule(1, 1, 128)))
    dense = _dense_layout((320, 256), 0, 3, 1, 1)  # rows 107..213: blocks 0 and 1
    lay = stored_layout(dense, spec, "layer")
    assert lay.segments() == [(0, 2)] and lay.for_rank(0).segments() == [(0, 1)]
    assert positions(dense, spec, 0).tolist() == [(107 + i) // 128 for i in range(107)]


def test_a_split_inside_a_packed_word_is_refused_with_the_fix():
    scheme = WeightQuant("compressed-tensors", "ct_pack", 4, True, "group", group_size=32)
    spec = stored_tensors(scheme, 64, 96)[0]
    dense = ShardLayout((64, 96), 2, 0, 1, (Piece(0, 96, ((0, 44), (44, 96))),))
    with pytest.raises(QuantizationError, match=r"layer: this rank's features \[0, 44\) of dim 1 cut the 8 values "
                                                r"packed in one word of weight_packed.*dequantize=True"):
        stored_layout(dense, spec, "layer")
