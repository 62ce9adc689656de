"""`Handle`: what an `async_op=True` collective returns.

`wait()` returns the result tensor (the same one on repeated calls; None for `barrier(async_op=True)`) and
`is_completed()` polls. Backends return a handle from their primitives either way (`Handle.completed` for
work already done); the public synchronous calls unwrap it, or skip it where a backend has a faster path.
"""
from __future__ import annotations

from typing import Callable

import torch


def _true() -> bool:
    return True


def _returns(result):
    return lambda: result


class Handle:
    """The result of an `async_op=True` call: `wait()` returns the tensor, `is_completed()` polls."""

    def __init__(self, wait: Callable[[], torch.Tensor | None], is_completed: Callable[[], bool]):
        self._wait = wait
        self._is_completed = is_completed
        self._result: torch.Tensor | None = None
        self._done = False

    @classmethod
    def completed(cls, result: torch.Tensor | None) -> "Handle":
        """A handle whose operation already finished (synchronous calls go through here)."""
        handle = cls.__new__(cls)
        handle._wait, handle._is_completed = _returns(result), _true
        handle._result, handle._done = result, True
        return handle

    def wait(self) -> torch.Tensor | None:
        """Block until the operation finished and return its result (the same tensor on repeated calls; None
        for a barrier)."""
        if not self._done:
            self._result = self._wait()
            self._done = True
        return self._result  # type: ignore[return-value]

    def is_completed(self) -> bool:
        return self._done or bool(self._is_completed())
