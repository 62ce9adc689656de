"""The stored formats fed to torch's CPU kernels: the same values in the kernels' own layouts."""
from __future__ import annotations

import pytest
import torch

from tpkit.quant.kernels import int4_kernel_layout, int4_linear, int8_linear, int8_values

pytest.importorskip("compressed_tensors")


@pytest.mark.parametrize("n,k", [(64, 256), (192, 128)])
def test_int4_words_rearrange_into_torchs_packed_layout(n, k):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(n))
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 1)
    assert torch.equal(int4_kernel_layout(pack_to_int32(q, 4)), want)


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
