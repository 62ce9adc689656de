"""Unpacking the integers a quantized checkpoint packs into int32 words, as tensor ops (no host sync).

Every packed format here puts `32 // bits` values in one word, value `j` of a word in bits `[j*bits, (j+1)*bits)`;
they differ in the dim they pack along, in the value offset and, for AWQ, in the order of the values in a word.
"""
from __future__ import annotations

import sys

import torch

_LITTLE_ENDIAN = sys.byteorder == "little"

#: AWQ's GEMM packing puts columns 0 2 4 6 1 3 5 7 of each run of eight into the word's values 0..7; reading the
#: values back in this order gives the columns in their natural order.
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_bits(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The unsigned values of int32 `packed`, `32 // bits` per word along `dim` (int32, the packed dim grown by
    that factor). `order`: the position in the word of each output value of a run (AWQ), default in order."""
    per = 32 // bits
    if bits == 4 and order is None and dim == packed.dim() - 1 and not torch.compiler.is_compiling():
        # nibbles in byte order, no shifts of int32s (eager); compiled, the shifts fuse into the reader's kernel
        # where a byte view of another dtype would be a copy
        b = packed.contiguous().view(torch.uint8)
        if not _LITTLE_ENDIAN and packed.device.type == "cpu":  # a word's bytes in reverse order
            b = b.unflatten(-1, (-1, 4)).flip(-1).flatten(-2)
        return torch.stack((b & 15, b >> 4), -1).flatten(-2).to(torch.int32)
    moved = packed.movedim(dim, -1)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    if order is not None:
        shifts = shifts[list(order)]
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2).movedim(-1, dim)


def unpack_signed(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """compressed-tensors' packing: signed values stored offset by `2 ** (bits - 1)`."""
    return unpack_bits(packed, bits, dim) - (1 << (bits - 1))
