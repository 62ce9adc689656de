"""Signatures: what ranks compare under `TP_DEBUG` before a collective (torch and mpi backends).

A signature is `SIGNATURE_LENGTH` ints describing one rank's call (operation, dtype, shape, arguments);
ranks of a correct collective have equal ones. Each backend gathers them its own way
(`Communicator._gather_signatures`); `check_signatures` turns a mismatch into a `CommError` that lists every
rank's call.
"""
from __future__ import annotations

import zlib
from typing import Callable, Sequence

import torch

from .all_to_all import size_mismatch
from .errors import CommError
from .ops import ReduceOp

_OP_CODES = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3, "broadcast": 4, "send": 5, "all_to_all": 6}
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
    compared instead. all_to_all inputs may differ along both its dims (`dim` the scatter dim, `src` the
    gather dim), so both are masked; `all_to_all_check` compares its sizes.
    """
    shape = list(tensor.shape)
    if op == "all_gather" and sizes is not None:
        shape[dim] = -1
    if op == "all_to_all":
        shape[dim] = shape[src] = -1
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
    a2a = row[0] == _OP_CODES["all_to_all"]
    if row[4] >= 0:
        parts.append(f"{'scatter_dim' if a2a else 'dim'} {row[4]}")
    if row[5] >= 0:
        parts.append(f"{'gather_dim' if a2a else 'src'} {row[5]}")
    return " ".join(parts)


def check_signatures(op: str, group: str, rows: list[list[int]]) -> None:
    """Raise `CommError` listing every rank's call when the ranks' signatures differ."""
    if any(row != rows[0] for row in rows):
        desc = "; ".join(f"rank {r}: {describe_signature(row)}" for r, row in enumerate(rows))
        raise CommError(f"{op}: ranks of group {group} passed mismatched tensors or arguments: {desc}")


def all_to_all_check(group: str, gather: Callable[[list[int]], list[list[int]]], tensor: torch.Tensor, sd: int,
                     gd: int, ss: list[int], gs: list[int]) -> None:
    """Under TP_DEBUG: raise `CommError` on every rank when the ranks' all_to_all calls do not fit together
    (dtype, dims, the other dims' sizes, and the piece sizes: `all_to_all.size_mismatch`). `gather` is the
    backend's `_gather_signatures`; two small gathers."""
    check_signatures("all_to_all", group, gather(signature("all_to_all", tensor, sd, None, src=gd)))
    problem = size_mismatch(gather(list(ss) + list(gs)), sd == gd)
    if problem:
        raise CommError(f"all_to_all: ranks of group {group} passed sizes that do not fit together: {problem}")
