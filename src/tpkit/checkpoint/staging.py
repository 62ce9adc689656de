"""Host -> device staging for loads: file bytes go into a few reused (pinned) host buffers, each copied to the
device asynchronously while the next one is read, so a load's host memory is the pool's, not the model's.

Why: `pread` writes host memory only. Reading a whole rank's shard into fresh host memory and then copying it
costs its size in RAM (and a page fault per page); reading into a small set of page-locked buffers makes each
copy a DMA that overlaps with the next read, and the buffers are reused. A buffer goes back to the pool only
once the copy that reads it has completed (a CUDA event recorded after it on the staging stream), never
earlier. Every device-side step of a load (the copies, and any transpose or dtype conversion after them) runs
on the staging stream, in issue order; `finish()` waits for all of it.

On the CPU the same path runs with ordinary buffers and synchronous copies: `TPKIT_LOAD_STAGING=1` forces it
for CPU loads, which is how the tests cover the code a GPU runs.
"""
from __future__ import annotations

import collections
import contextlib
import os
import threading
from typing import Iterator

import torch

from ..comm.pinned import PinnedBuffer, PinnedBufferPool
from ..distributed import read_launch_env

CHUNK_BYTES = 16 << 20  # one staging buffer: large enough that a copy's fixed cost is noise
SLOTS = 4  # buffers in the pool: reads and copies in flight at once (64 MiB of host memory in all)
FORCE_ENV = "TPKIT_LOAD_STAGING"


def load_device(device: torch.device | str | int | None, comm) -> torch.device:
    """The device a load fills: `device` if given, else the rank's device: under nccl `cuda:LOCAL_RANK` (modulo
    the devices there are, as `tpkit.init` binds it; the current CUDA device without a launcher), the CPU
    otherwise."""
    if device is not None:
        return torch.device(device)
    if getattr(comm, "torch_backend", None) == "nccl":
        env = read_launch_env()
        index = env.local_rank % torch.cuda.device_count() if env.launcher != "none" else torch.cuda.current_device()
        return torch.device("cuda", index)
    return torch.device("cpu")


def staging_for(device: torch.device) -> "Staging | None":
    """A `Staging` for a load onto `device`: always for an accelerator, for the CPU only when forced."""
    if device.type != "cpu" or os.environ.get(FORCE_ENV, "0") == "1":
        return Staging(device)
    return None


class _Done:
    """The CPU's stand-in for an event: a CPU copy has completed when `copy_` returns."""

    @staticmethod
    def synchronize() -> None:
        return None


class Staging:
    """`buffer()` -> read into it -> `send(buf, nbytes, dst)`; the buffer is reused after the copy completes.

    At most `slots` buffers exist; a thread asking for one when all are taken waits for the oldest copy in flight.
    Thread-safe: several reader threads share one Staging."""

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES, slots: int = SLOTS):
        self.device, self.chunk_bytes = torch.device(device), int(chunk_bytes)
        cuda = self.device.type == "cuda"
        self.pool = PinnedBufferPool(self.chunk_bytes * slots, pin=True if cuda else False)
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        if cuda:  # memory just allocated may still be in use by work queued on the current stream: go after it
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._free = slots
        self._sent: collections.deque[tuple[object, PinnedBuffer]] = collections.deque()
        self._cond = threading.Condition()
        self.copies = 0  # chunks sent (tests check the path was taken)

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Device work issued inside runs on the staging stream (after the copies already issued there)."""
        if self.stream is None:
            yield
        else:
            with torch.cuda.stream(self.stream):
                yield

    def buffer(self) -> PinnedBuffer:
        """A staging buffer of `chunk_bytes`, free for this caller until `send` or `give_back`."""
        with self._cond:
            while self._free == 0:
                if self._sent:  # reuse the oldest buffer once its copy has completed
                    done, buf = self._sent.popleft()
                    done.synchronize()
                    buf.release()
                    self._free += 1
                else:  # every buffer is being filled by another thread: wait for one to be sent
                    self._cond.wait()
            self._free -= 1
        return self.pool.acquire(self.chunk_bytes)

    def send(self, buf: PinnedBuffer, nbytes: int, dst: torch.Tensor) -> None:
        """Copy the buffer's first `nbytes` into `dst` (a contiguous uint8 view of device memory) without
        waiting; the buffer is reused once that copy has completed."""
        with self.on_stream():
            dst.copy_(buf.view((nbytes,), torch.uint8), non_blocking=True)
            done = self.record()
        with self._cond:
            self._sent.append((done, buf))
            self.copies += 1
            self._cond.notify()

    def record(self):
        """A marker of the work issued so far on the staging stream: `.synchronize()` waits for it."""
        if self.stream is None:
            return _Done()
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def give_back(self, buf: PinnedBuffer) -> None:
        """Return a buffer that was never sent (its read failed)."""
        buf.release()
        with self._cond:
            self._free += 1
            self._cond.notify()

    def finish(self) -> None:
        """Wait for every copy and every step issued on the staging stream; release the buffers."""
        if self.stream is not None:
            self.stream.synchronize()
        with self._cond:
            while self._sent:
                done, buf = self._sent.popleft()
                done.synchronize()
                buf.release()
                self._free += 1
            self._cond.notify_all()
        self.pool.clear()
