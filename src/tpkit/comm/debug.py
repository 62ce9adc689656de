"""`TP_DEBUG`: the switch for per-call logging and the ranks' signature checks (`signatures.py`).

Any value other than empty or `0` turns it on. Every public operation of a `Communicator` reads it once per
call, so it can be flipped while a program runs; the read is one lookup in the dictionary behind `os.environ`
(`os.environ.get` encodes the key and decodes the value first, 20x slower, and this runs on every collective). Logs go to the `tpkit` logger; with `TP_DEBUG` on and no
logging configured, a handler is added so the lines are visible.
"""
from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger("tpkit")
_handler_lock = threading.Lock()

getenv = os.environ.get
OFF = ("", "0")  # the values of TP_DEBUG that mean off
# os.environ keeps its variables encoded in a plain dict (`_data`) that its setters update; where that is not
# so (another Python), fall back to os.environ.get.
_ENVIRON = getattr(os.environ, "_data", None)
if _ENVIRON is not None:
    _KEY = os.environ.encodekey("TP_DEBUG")
    _OFF_ENCODED = (None,) + tuple(os.environ.encodevalue(v) for v in OFF)


def debug_enabled() -> bool:
    """True when `TP_DEBUG` is set to something other than empty or 0."""
    if _ENVIRON is not None:
        return _ENVIRON.get(_KEY) not in _OFF_ENCODED
    return getenv("TP_DEBUG", "") not in OFF


def _ensure_handler() -> None:
    """Make `TP_DEBUG=1` visible without the user configuring logging first."""
    with _handler_lock:
        if logger.level == logging.NOTSET or logger.level > logging.DEBUG:
            logger.setLevel(logging.DEBUG)
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[tpkit %(asctime)s] %(message)s"))
            logger.addHandler(handler)


def log_call(opname: str, tensor, details: dict, group: str, rank: int, world_size: int, backend: str) -> None:
    """One debug line for a call: the operation, the tensor's shape and dtype, its arguments, who called."""
    _ensure_handler()
    what = "" if tensor is None else f" shape={tuple(tensor.shape)} dtype={tensor.dtype}"
    extra = "".join(f" {k}={v}" for k, v in details.items())
    logger.debug("%s%s%s group=%s rank=%d/%d backend=%s", opname, what, extra, group, rank, world_size, backend)
