"""The one exception type for communication failures, and the guard that turns other failures into it.

Every backend turns its own failure (a gloo socket error, an NCCL watchdog abort, an MPI error, a thread
that never arrived) into `CommError`, so callers catch one type and read one kind of message: which
operation, on which group, and what went wrong.
"""
from __future__ import annotations


class CommError(RuntimeError):
    """A collective or point-to-point operation failed: timeout, dead peer, or mismatched arguments."""


# Errors a collective raises as they are: argument errors (before any peer is involved) and CommError itself.
PASS_THROUGH = (CommError, ValueError, TypeError)


class Guard:
    """`with comm._guard(op):` turns any other failure into the `CommError` `comm._error(op, exc)` describes. A
    plain class rather than a generator context manager: it runs on every call, and this costs a third as much."""

    __slots__ = ("comm", "op")

    def __init__(self, comm, op: str):
        self.comm, self.op = comm, op

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> bool:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, PASS_THROUGH):
            return False
        raise self.comm._error(self.op, exc) from exc
