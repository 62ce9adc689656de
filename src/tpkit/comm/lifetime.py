"""What a communicator holds across calls: its one async worker thread and whether it is closed.

`Communicator` inherits this; the collectives themselves live in `communicator.py`. Kept apart because it is
the one part with state that outlives a call: `close()` must drain the worker before the backend releases
its resources, and a closed communicator refuses every operation by name.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from .errors import CommError
from .handle import Handle


class Lifetime:
    """The async worker and the closed state of a communicator (see `Communicator.close`)."""

    _name: str
    _closed: bool
    _executor: ThreadPoolExecutor | None
    _pending: list

    @property
    def closed(self) -> bool:
        """Whether `close()` was called; every operation of a closed communicator raises `CommError`."""
        return self._closed

    def close(self) -> None:
        """Release what this communicator holds (the seed's IDisposable): its async worker thread (after
        pending operations finish), and the backend's resources (`_close`): a process group or MPI
        communicator it made, its shared-memory mapping; wrappers close what they wrap and drop their staging
        buffers. Idempotent. Call it on every rank of the group, like a collective (MPI frees communicators
        collectively). Afterwards every operation raises `CommError` naming the call; results already
        returned, and a profiler's records, stay valid.

        The world process group is left to `tpkit.shutdown()`, which knows whether tpkit started it.
        """
        if self._closed:
            return
        try:
            self._drain()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._close()
        finally:
            self._closed = True
            # Replacing the operations on the instance keeps the check off the per-call path.
            what = repr(self)
            for name in _OPERATIONS:
                setattr(self, name, _refusal(name, what))

    def _close(self) -> None:
        """Backend hook for `close()`: release the backend's own resources."""

    def __enter__(self) -> "Lifetime":
        return self

    def __exit__(self, kind, exc, traceback) -> bool:
        self.close()
        return False


    def _in_background(self, fn: Callable[[], torch.Tensor], async_op: bool) -> Handle:
        """Run `fn` now, or on this communicator's one worker thread when `async_op` is set.

        One worker keeps operations in the order they were issued, which collectives require. Synchronous
        calls first wait for pending async ones (`_drain`) for the same reason.
        """
        if not async_op:
            self._drain()
            return Handle.completed(fn())
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tpkit-{self._name}")
        future = self._executor.submit(fn)
        self._pending.append(future)
        return Handle(future.result, future.done)

    def _drain(self) -> None:
        """Wait for async operations issued earlier on this communicator; their errors surface in `wait`."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        for future in pending:
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - reported by the handle's own wait()
                pass


_OPERATIONS = ("all_reduce", "all_reduce_", "all_gather", "all_to_all", "reduce_scatter", "broadcast", "barrier", "send",
               "recv", "new_group")


def _refusal(op: str, what: str) -> Callable[..., None]:
    """What `op` becomes on a closed communicator (`what` describes it)."""
    def closed(*args, **kwargs) -> None:
        raise CommError(f"{op}: {what} is closed; make a new communicator (tpkit.comm.create_communicator, "
                        f"tpkit.init) to communicate again")
    closed.__name__ = op
    return closed
