"""The stored formats fed to torch's CPU kernels: the same values in the kernels' own layouts."""
from __future__ import annotations

import pytest
import torch

from tpkit.quant.kernels import int4_kernel_block, int4_kernel_layout, int4_linear, int8_linear, int8_values

pytest.importorskip("compressed_tensors")


@pytest.mark.parametrize("n,k", [(64, 256), (192, 128)])
def test_int4_words_rearrange_into_torchs_packed_layout(n, k):
    """Into this CPU's layout as torch's own converter makes it (64-row blocks with AVX-512, 32 with AVX2 only: the
    64-row layout on an AMD Zen 3 gave sums 1.5x off), and into each block size as its definition says: byte
    (block, feature, j) holds row j's value low and row j + rows / 2's high."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(n))
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 1)
    assert int4_kernel_block() is not None
    assert torch.equal(int4_kernel_layout(pack_to_int32(q, 4), int4_kernel_block()), want)
    u = (q.to(torch.int32) + 8).to(torch.uint8)
    for rows in (64, 32):
        got = int4_kernel_layout(pack_to_int32(q, 4), rows).view(n // rows, k, rows // 2)
        for b, f, j in [(0, 0, 0), (n // rows - 1, k - 1, rows // 2 - 1), (n // rows - 1, 3, 5)]:
            assert int(got[b, f, j]) == int(u[b * rows + j, f]) | (int(u[b * rows + j + rows // 2, f]) << 4)


def test_kernels_compute_the_dequantized_product():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    n, k, group = 128, 256, 64
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g)
    z = torch.randint(-8, 8, (n, k // group), dtype=torch.int8, generator=g)
    s = torch.rand(n, k // group, generator=g) + 0.01
    x = torch.randn(3, 5, k, generator=g)
    dense = (q.float() - z.float().repeat_interleave(group, 1)) * s.repeat_interleave(group, 1)
    got = int4_linear(x, pack_to_int32(q, 4), s, z, group)
    assert torch.allclose(got, x @ dense.t(), rtol=1e-5, atol=1e-4)
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    s8 = torch.rand(n, 1, generator=g)
    assert torch.equal(int8_values(pack_to_int32(q8, 8)), q8)
    assert torch.allclose(int8_linear(x, pack_to_int32(q8, 8), s8), x @ (q8.float() * s8).t(), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_int8_kernel_is_offered_only_on_widths_it_computes(dtype):
    """torch's int8 kernel sums bf16 inputs in blocks of 16 features with no tail: 40 features gave wrong sums and
    43 (a row split of 128 over 3 ranks) a segfault. A layer is offered it only where its width is whole blocks,
    and there it equals the dequantized product at each dtype."""
    from tpkit.quant.compressed_tensors import CompressedTensors
    from tpkit.quant.kernels import INT8_K_MULTIPLE
    from tpkit.quant.schemes import WeightQuant

    q = WeightQuant("compressed-tensors", "ct_int", 8, True, "channel")
    offered = {k: [p.name for p in CompressedTensors().products(q, (64, k), False, dtype, dtype)]
               for k in (16, 40, 43, 48, 128)}
    assert {k for k, names in offered.items() if "int8" in names} == {16, 48, 128}, offered
    g = torch.Generator().manual_seed(1)
    for k in (INT8_K_MULTIPLE, 3 * INT8_K_MULTIPLE, 208):
        q8 = torch.randint(-128, 128, (43, k), dtype=torch.int8, generator=g)
        s8 = torch.rand(43, 1, generator=g).to(dtype)
        x = torch.randn(5, k, generator=g).to(dtype)
        dense = q8.double() * s8.double()
        want, size = x.double() @ dense.t(), x.double().abs() @ dense.abs().t()
        err = (int8_linear(x, q8, s8).double() - want).abs()
        assert (err <= (1e-2 if dtype == torch.bfloat16 else 1e-5) * size).all(), (k, err.max())
