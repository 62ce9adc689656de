"""Signatures: what ranks compare under `TP_DEBUG` before a collective (torch and mpi backends).

A signature is `SIGNATURE_LENGTH` ints describing one rank's call (operation, dtype, shape, arguments);
ranks of a correct collective have equal ones. Each backend gathers them its own way
(`Communicator._gather_signatures`); `check_signatures` turns a mismatch into a `CommError` that lists every
rank's call.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import torch

from .errors import CommError
from .ops import ReduceOp

_OP_CODES = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3, "broadcast": 4, "send": 5}
_OP_NAMES = {v: k for k, v in _OP_CODES.items()}
_MAX_DIMS = 8  # dimensions spelled out in a report; all of them are compared (through a hash)
SIGNATURE_LENGTH = 8 + _MAX_DIMS


def _dtype_code(dtype: torch.dtype) -> int:
    """The same number for the same dtype in every process (unlike an order-of-first-use counter)."""
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF


_DTYPES = {_dtype_code(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def dtype_of_code(code: int) -> torch.dtype | None:
    return _DTYPES.get(code)


def _ints_hash(values: Sequence[int]) -> int:
    """A hash of ints that every process agrees on (Python does not randomise the hashing of ints)."""
    return hash(tuple(int(v) for v in values))


def signature(op: str, tensor: torch.Tensor, dim: int = -1, sizes: Sequence[int] | None = None,
              reduce_op: ReduceOp | None = None, src: int = -1) -> list[int]:
    """`SIGNATURE_LENGTH` ints describing one rank's call; ranks of a correct collective have equal ones.

    all_gather shards may differ along `dim` when `sizes` is given, so that size is masked and `sizes`
    compared instead.
    """
    shape = list(tensor.shape)
    if op == "all_gather" and sizes is not None:
        shape[dim] = -1
    reduce_code = -1 if reduce_op is None else list(ReduceOp).index(reduce_op)
    head = [_OP_CODES[op], _dtype_code(tensor.dtype), tensor.dim(), reduce_code, dim, src,
            0 if sizes is None else _ints_hash(sizes), _ints_hash(shape)]
    return head + (shape + [0] * _MAX_DIMS)[:_MAX_DIMS]


def sent_shape(row: Sequence[int]) -> list[int] | None:
    """The shape a signature describes, if it is spelled out in full."""
    return list(row[8:8 + row[2]]) if row[2] <= _MAX_DIMS else None


def describe_signature(row: Sequence[int], with_op: bool = True) -> str:
    ndim = row[2]
    shape = list(row[8:8 + min(ndim, _MAX_DIMS)]) + (["..."] if ndim > _MAX_DIMS else [])
    parts = [_OP_NAMES.get(row[0], "?")] if with_op else []
    parts += [str(_DTYPES.get(row[1], "?")), f"shape {shape}"]
    if row[3] >= 0:
        parts.append(list(ReduceOp)[row[3]].name)
    if row[4] >= 0:
        parts.append(f"dim {row[4]}")
    if row[5] >= 0:
        parts.append(f"src {row[5]}")
    return " ".join(parts)


def check_signatures(op: str, group: str, rows: list[list[int]]) -> None:
    """Raise `CommError` listing every rank's call when the ranks' signatures differ."""
    if any(row != rows[0] for row in rows):
        desc = "; ".join(f"rank {r}: {describe_signature(row)}" for r, row in enumerate(rows))
        raise CommError(f"{op}: ranks of group {group} passed mismatched tensors or arguments: {desc}")
