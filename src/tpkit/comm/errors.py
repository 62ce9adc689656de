"""The one exception type for communication failures.

Every backend turns its own failure (a gloo socket error, an NCCL watchdog abort, an MPI error, a thread
that never arrived) into `CommError`, so callers catch one type and read one kind of message: which
operation, on which group, and what went wrong.
"""
from __future__ import annotations


class CommError(RuntimeError):
    """A collective or point-to-point operation failed: timeout, dead peer, or mismatched arguments."""
