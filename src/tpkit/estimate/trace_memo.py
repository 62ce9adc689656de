"""Steps this process already traced, kept: a config traced under the same split at the same shapes is the same
trace, so it is traced once.

Why: a trace runs a converted copy's step on fake tensors, 0.3-1 s for a 3-layer Llama on a 2-core box, and the
commands ask for the same traces again: `tpkit analyze` runs the setup search at each world size it considers,
and those searches share setups (one rank and its data-parallel replicas at the same local batch, the same split
at another world size). 6 of a 3-layer Llama's analyze's 26 traces were repeats; kept, it took 21 s, not 35. A
program that estimates, then searches, then analyzes one model asks for them again. The key is everything a trace
is made from (`calls.trace_source`: the config's every field, its class, dtype and attention kernel; the split;
the step's shapes; the registry's generation, so a family registered since does not meet an old plan); a module
whose weights or code a key cannot stand for is traced each time. A `StepTrace` is frozen, and `predict` only
reads the kept weightless model.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable

KEEP = 128  # traces kept (each its op list and a weightless model), the least recently asked for dropped first

_KEPT: OrderedDict = OrderedDict()
_LOCK = threading.Lock()  # thread-ranks may price at once


def remembered(key: Hashable | None, make: Callable[[], Any], errors: tuple[type[Exception], ...] = ()) -> Any:
    """The value kept for `key`, else `make()`, kept (a None `key`: made each time, nothing kept). An exception of
    `errors` is kept too and raised again for that key (a split the planner refuses, which the search asks for at
    every layer count and world size)."""
    if key is None:
        return make()
    with _LOCK:
        if key in _KEPT:
            _KEPT.move_to_end(key)
            kept = _KEPT[key]
            if isinstance(kept, _Refused):
                raise kept.error.with_traceback(None)
            return kept
    try:
        value = make()
    except errors as exc:
        value = _Refused(exc.with_traceback(None))  # not its frames: they hold the traced copies
    with _LOCK:
        _KEPT[key] = value
        while len(_KEPT) > KEEP:
            _KEPT.popitem(last=False)
    if isinstance(value, _Refused):
        raise value.error.with_traceback(None)
    return value


class _Refused:
    """A kept exception (a value that is one would be returned, not raised)."""

    def __init__(self, error: Exception):
        self.error = error


def forget() -> None:
    """Drop every kept trace (a test that changes what a trace is made of without changing its key)."""
    with _LOCK:
        _KEPT.clear()
