"""The current thread's communicator: how a thread-rank knows which rank it is.

Under the `threads` backend every rank is a thread of one process, so "the default communicator" must be
per thread. This lives in `comm` (not in `tpkit.distributed`) so that `run_threads` can set it without
importing upward; `tpkit.get_communicator()` reads it first.
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from .communicator import Communicator

_thread_local = threading.local()


def current_thread_communicator() -> "Communicator | None":
    """The communicator set for this thread by `use_communicator`, or None."""
    return getattr(_thread_local, "comm", None)


@contextlib.contextmanager
def use_communicator(comm: "Communicator") -> Iterator["Communicator"]:
    """Make `comm` the default for the current thread only, inside the block (how thread-ranks get theirs)."""
    previous = getattr(_thread_local, "comm", None)
    _thread_local.comm = comm
    try:
        yield comm
    finally:
        _thread_local.comm = previous
