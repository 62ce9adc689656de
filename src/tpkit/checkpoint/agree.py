"""Ranks agree before anything changes: every rank validates, then one exchange tells all of them whether any
rank found a problem, and what it was, so every rank raises the same `CheckpointError` and none is left waiting
in a collective that the others skipped.
"""
from __future__ import annotations

import torch

from .errors import CheckpointError


def gather_bytes(comm, data: bytes) -> list[bytes]:
    """Every rank's `data`, in rank order (two all_gathers: lengths, then the padded bytes)."""
    if comm.world_size == 1:
        return [data]
    sizes = comm.all_gather(torch.tensor([len(data)], dtype=torch.int64)).tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = comm.all_gather(buf.unsqueeze(0)).reshape(len(sizes), -1)
    return [bytes(rows[r, :n].tolist()) for r, n in enumerate(sizes)]


def agree(comm, error: BaseException | None) -> None:
    """Raise on every rank if any rank passes an error (the first failing rank's message, re-raised as a
    CheckpointError); return on every rank otherwise."""
    if comm is None or comm.world_size == 1:
        if error is not None:
            raise error
        return
    # An explicit dtype: the default one is process-wide, and another thread-rank may be building a model under
    # a different one this moment (transformers switches it while it builds); ranks must pass equal tensors.
    flag = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float32)
    if comm.all_reduce(flag).item() == 0:
        return
    messages = gather_bytes(comm, b"" if error is None else str(error).encode())
    if isinstance(error, CheckpointError):
        raise error
    rank, msg = next((r, m.decode()) for r, m in enumerate(messages) if m)
    if error is not None:
        raise CheckpointError(msg) from error
    raise CheckpointError(f"{msg} (found by rank {rank})")
