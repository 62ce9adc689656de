"""Process-unique integer ids for communicators: how compiled graphs name one (`traceable`'s custom ops take
the id, since a graph cannot hold a Python object). Every `Communicator` registers itself when made; ids live
as long as their communicator (a weak registry).
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

_REGISTRY: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)
_LOCK = threading.Lock()


def register(comm: Any) -> int:
    """A process-unique integer for `comm` (the key the custom ops look it up by); idempotent."""
    cid = comm.__dict__.get("_comm_id")
    if cid is None:
        with _LOCK:
            cid = next(_IDS)
            _REGISTRY[cid] = comm
            comm.__dict__["_comm_id"] = cid
    return cid


def live() -> list[Any]:
    """Every communicator of this process still alive, oldest first."""
    with _LOCK:
        return [c for _, c in sorted(_REGISTRY.items())]


def lookup(comm_id: int) -> Any:
    comm = _REGISTRY.get(int(comm_id))
    if comm is None:
        raise KeyError(f"no live communicator with id {comm_id}")
    return comm
