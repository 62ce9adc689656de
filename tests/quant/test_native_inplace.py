"""The compiled product reads a layer's scales and zero points where the checkpoint stored them (`native.gemv`):
bf16 / fp16 scales converted to float32 in the kernel, zero points as int8 values or compressed-tensors' packed int32
words, the values' storage offset a scalar. Each in-place form gives, bit for bit, what the float32 form of the same
values gives (the tables a load used to make: float32 scales, zero points unpacked), since the kernel computes in
float32 from the same values; and both equal the dequantized weight's product. Run on every instruction-set path
(`TPKIT_NATIVE_ISA`: AVX-512 where the CPU has it, AVX2, x86-64's baseline)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkit.quant import native
from tpkit.quant.packing import unpack_signed

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler built tpkit's native product here")

def _blocks(t: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    return t.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


def pack_rows(z: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' packed zero points: signed `z` `[R, KB]` plus `2 ** (bits - 1)`, `32 // bits` rows to an
    int32 word along the rows (value `j` of a word in bits `[j*bits, (j+1)*bits)`)."""
    per = 32 // bits
    u = torch.zeros(-(-z.shape[0] // per) * per, z.shape[1], dtype=torch.int64)
    u[:z.shape[0]] = z.long() + (1 << (bits - 1))
    u = u.view(-1, per, z.shape[1])
    words = sum(u[:, j] << (bits * j) for j in range(per))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _values(kind: str, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored values of `kind`, their decoded `[n, k]` float32 before the offset and zero point)."""
    if kind == "int8":
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        return q, q.float()
    if kind == "uint8":
        q = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
        return q, q.float()
    if kind == "uint4":
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), q.float()
    f8 = (torch.randn(n, k, generator=g) * 64).to(torch.float8_e4m3fn)
    return f8, f8.float()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 70), half_k=st.integers(1, 200), rows=st.sampled_from([1, 2, 5, 8]),
       bh=st.sampled_from([1, 1, 3, 16]), bw=st.sampled_from([2, 8, 32, 64, 128, 0]),
       kind=st.sampled_from(["int8", "uint8", "uint4", "fp8"]),
       scale_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       zeros=st.sampled_from(["none", "offset", "int8", "packed"]), seed=st.integers(0, 2 ** 16))
def _inplace_equals_float32_tables(n, half_k, rows, bh, bw, kind, scale_dtype, zeros, seed):
    k = 2 * half_k
    bw = bw or k  # 0: one block per row (per-channel scales)
    if kind == "fp8":
        zeros = "none"  # FP8 values are symmetric
    if zeros == "packed":
        bh = 1  # packed zero points run along the rows, one per row (group / channel strategies)
    g = torch.Generator().manual_seed(seed)
    bits = 4 if kind == "uint4" else 8
    offset = 1 << (bits - 1) if kind in ("uint8", "uint4") and zeros != "none" else 0  # compressed-tensors' words
    nb, kb = -(-n // bh), -(-k // bw)
    x = torch.randn(rows, k, generator=g)
    w, decoded = _values(kind, n, k, g)
    s = (torch.rand(nb, kb, generator=g) * 0.05 + 1e-3).to(scale_dtype)
    z = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (nb, kb), dtype=torch.int8, generator=g)
    if zeros in ("none", "offset"):
        z.zero_()
    stored = {"none": None, "offset": None, "int8": z, "packed": pack_rows(z, bits)}[zeros]
    got = native.gemv(x, w, kind, n, s, stored, (bh, bw), offset, bits if zeros == "packed" else 0)
    # the float32 form of the same values: scales as float32, zero points unpacked to one int8 per block
    if zeros == "packed":
        assert torch.equal(unpack_signed(stored, bits, 0)[:nb], z.int())
    table = None if zeros == "none" else z
    want = native.gemv(x, w, kind, n, s.float(), table, (bh, bw), offset)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (kind, zeros, scale_dtype)
    zb, sb = _blocks(z.double() + offset, (bh, bw), (n, k)), _blocks(s.double(), (bh, bw), (n, k))
    ref = x.double() @ ((decoded.double() - zb) * sb).t()
    size = x.double().abs() @ ((decoded.double().abs() + zb.abs()) * sb).t()  # the factored sums' size
    assert ((got.double() - ref).abs() <= 1e-5 * size + 1e-30).all(), (kind, zeros, scale_dtype)


def test_in_place_scales_and_zero_points_equal_the_float32_tables(build):
    """int4 / int8 / packed int8 / FP8 values; float32, bf16 and fp16 scales; no zero point, the offset alone
    (symmetric compressed-tensors), int8 zero points (`int-quantized`), packed int32 ones (`pack-quantized`
    asymmetric); shapes with tails past the vector width and blocks of rows."""
    _inplace_equals_float32_tables()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_half_scale_converts_exactly(build, dtype):
    """Each finite bf16 / fp16 bit pattern as a scale (one weight of 1 per row) gives its float32 value: normals,
    fp16 subnormals (normalized by shifts), zeros. (An infinite scale gives NaN, as it always did: the kernel adds
    scale x 0 for its empty vector lanes.)"""
    s = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    s = s[s.isfinite()].reshape(-1, 1).contiguous()
    w = torch.ones(s.shape[0], 1, dtype=torch.int8)
    got = native.gemv(torch.ones(1, 1), w, "int8", s.shape[0], s, None, (1, 1))[0]
    assert torch.equal(got, s.float()[:, 0])


def test_a_layout_the_kernel_does_not_read_is_refused():
    x, w = torch.randn(1, 64), torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(TypeError, match="scales in torch.float64"):
        native.gemv(x, w, "int8", 4, torch.ones(4, 1, dtype=torch.float64), None, (1, 64))
    with pytest.raises(TypeError, match="zero points in torch.int32 with zero_bits 0"):
        native.gemv(x, w, "int8", 4, torch.ones(4, 1), torch.zeros(1, 1, dtype=torch.int32), (1, 64))
    with pytest.raises(ValueError, match="contiguous"):
        native.gemv(x, w, "int8", 4, torch.ones(1, 8)[:, ::2], None, (4, 16))
