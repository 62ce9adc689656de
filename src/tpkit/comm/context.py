"""The current thread's communicator (how a thread-rank knows which rank it is) and the process's default.

Under the `threads` backend every rank is a thread of one process, so "the default communicator" must be
per thread. This lives in `comm` (not in `tpkit.distributed`) so that `run_threads` can set it without
importing upward; `tpkit.get_communicator()` reads it first.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

# Communicators are typed `Any` here: this module sits below `communicator.py` (which reads it to rebind a
# pickled communicator, `rebind.py`), so it must not import it, even for type checkers.
Communicator = Any

_thread_local = threading.local()
_process: "list[Communicator | None]" = [None]
_world_of_one: "list[Callable[[], Communicator]]" = []


def current_thread_communicator() -> "Communicator | None":
    """The communicator set for this thread by `use_communicator`, or None."""
    return getattr(_thread_local, "comm", None)


def process_communicator() -> "Communicator | None":
    """The communicator `tpkit.init` / `tpkit.set_communicator` made the default for the whole process, or None."""
    return _process[0]


def set_process_communicator(comm: "Communicator | None") -> None:
    _process[0] = comm


def register_world_of_one(make: "Callable[[], Communicator]") -> None:
    """How to make a communicator of one rank (the threads backend registers it when `tpkit.comm` loads)."""
    _world_of_one[:] = [make]


def world_of_one() -> "Communicator":
    """A new communicator of one rank."""
    return _world_of_one[0]()


@contextlib.contextmanager
def use_communicator(comm: "Communicator") -> Iterator["Communicator"]:
    """Make `comm` the default for the current thread only, inside the block (how thread-ranks get theirs)."""
    previous = getattr(_thread_local, "comm", None)
    _thread_local.comm = comm
    try:
        yield comm
    finally:
        _thread_local.comm = previous
