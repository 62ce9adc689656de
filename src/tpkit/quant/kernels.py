"""torch's CPU weight-only kernels for the formats that map onto them, fed from the packed tensors as stored.

- int4, group 32 / 64 / 128 / 256 (compressed-tensors `pack-quantized`): `_weight_int4pack_mm_for_cpu`, whose
  packed layout holds, per block of B output rows and per input feature, rows `j` and `j + B / 2` in one byte. B
  is the CPU's: torch 2.13 packs 64 rows where it has AVX-512 and 32 with AVX2 only (an AMD Zen 3), so
  `int4_kernel_block` asks torch's own converter once which it is (the 64-row layout fed to the AVX2 kernel gave
  sums 1.5x off). `int4_kernel_layout` rearranges the stored nibbles into it (a few byte passes, no unpacking to
  int32), and the
  kernel's `w = (q - 8) * scale + zero` takes compressed-tensors' `(q_signed - zp) * scale` as
  `zero = -zp * scale`.
- int8 per channel, symmetric (`pack-quantized` 8-bit or `int-quantized`): `_weight_int8pack_mm` on the int8
  values (a packed word's bytes are the values plus 128: one XOR gives them), where the input features are a
  multiple of `INT8_K_MULTIPLE`.

Both compute in a different order than dequantize-then-matmul (a few float32 ulps), and in the activations'
dtype: they equal the format's dense weight only when the scales are stored in the dtype the layer computes in.
A bf16 checkpoint's weight is `(q - z) * s` rounded to bf16 (compressed-tensors dequantizes in the scale's dtype,
and transformers' load does): computed in float32 by a kernel, it would be 2e-3 off that load's logits. So a
format's `product` (`compressed_tensors.py`) says which applies to a layer's local slice (the scales must cover
whole groups from its first feature on: no `positions` map; the scales' dtype the compute dtype); every other
case, and any input that needs a gradient (the kernels have none), dequantizes per call. The int8 kernel reads the stored values in place, and
faults on bf16 activations when they do not start on a 64-byte boundary (a view of the file's mapping may not):
`aligned` gives a load such a tensor to copy once.
"""
from __future__ import annotations

import functools

import torch

INT4_GROUPS = (32, 64, 128, 256)


KERNEL_ALIGNMENT = 64  # bytes: where torch's CPU allocator starts a tensor, and the int8 kernel's loads assume
INT8_K_MULTIPLE = 16  # input features: the int8 kernel's bf16 path reads whole blocks of 16 and has no tail (torch
# 2.13: 40 features gave wrong sums, 43 at a row split over 3 ranks a segfault), so other widths dequantize


@functools.cache
def int4_kernel_block() -> int | None:
    """The output rows per block of torch's int4 layout on this CPU (see the module docstring), read off torch's own
    converter on a small random weight; None where none of 64, 32, 16 matches it (or torch lacks the kernel): no
    int4 product is offered then."""
    q = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    try:
        want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1).view(torch.uint8).reshape(-1)
    except (RuntimeError, AttributeError):
        return None
    words = sum(q[:, t::8] << (4 * t) for t in range(8))  # compressed-tensors' words of the same values
    for rows in (64, 32, 16):
        if torch.equal(int4_kernel_layout(words, rows).view(torch.uint8).reshape(-1), want):
            return rows
    return None


def int4_kernel_layout(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """compressed-tensors' int4 words `[N, K / 8]` (value + 8, value `j` in bits `4j..4j+3`) in the layout of
    `torch.ops.aten._convert_weight_to_int4pack_for_cpu` (`[N, K / 2]` bytes) that pairs rows `j` and `j + rows / 2`
    per block of `rows` (`int4_kernel_block()`; N a multiple of it)."""
    n = packed.shape[0]
    blocks = packed.contiguous().view(n // rows, 2, rows // 2, -1)
    low, high = blocks[:, 0], blocks[:, 1]  # rows j and j + rows / 2 of each block, [blocks, rows / 2, K / 8] words
    # a word's nibbles t = 0..7 are features 8w + t: pair row j's nibble (low half) with row j + rows / 2's (high),
    # even t and odd t in the bytes of two words, then interleave the bytes back into feature order
    mask = 0x0F0F0F0F
    even = (low & mask) | ((high & mask) << 4)
    odd = ((low >> 4) & mask) | (high & ~mask)
    pairs = torch.stack((even.view(torch.uint8), odd.view(torch.uint8)), -1).flatten(-2)  # [blocks, 32, K]
    return pairs.transpose(1, 2).contiguous().view(n, -1)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                group: int) -> torch.Tensor:
    """`x W^T` for compressed-tensors int4 `packed` `[N, K/8]`, `scale` `[N, K/g]`, signed `zero_point`
    `[N, K/g]` (None: symmetric), in `x`'s dtype."""
    s = scale.to(x.dtype)
    zero = torch.zeros_like(s) if zero_point is None else -(zero_point.to(x.dtype) * s)
    sz = torch.stack((s.t(), zero.t()), -1).contiguous()
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # the kernels read rows in place
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, int4_kernel_layout(packed, int4_kernel_block()), group, sz)
    return y.view(*x.shape[:-1], y.shape[-1])


def int8_values(stored: torch.Tensor) -> torch.Tensor:
    """int8 values `[N, K]` from `pack-quantized` 8-bit words (`[N, K / 4]` int32) or `int-quantized` int8."""
    if stored.dtype == torch.int8:
        return stored
    return (stored.contiguous().view(torch.uint8) ^ 0x80).view(torch.int8)


def int8_linear(x: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x W^T` for per-channel symmetric int8 weights (`scale` `[N, 1]`), in `x`'s dtype."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # the kernels read rows in place
    y = torch.ops.aten._weight_int8pack_mm(flat, int8_values(stored), scale.reshape(-1).to(x.dtype))
    return y.view(*x.shape[:-1], y.shape[-1])


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it when its data does not start on a `KERNEL_ALIGNMENT` boundary."""
    return t if t.data_ptr() % KERNEL_ALIGNMENT == 0 else t.clone(memory_format=torch.contiguous_format)
