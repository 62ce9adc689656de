"""`PinnedBufferPool`: reusable page-locked host buffers for CPU <-> GPU staging.

Why: a copy from pageable memory goes through a hidden bounce buffer and cannot overlap with compute;
from pinned (page-locked) memory it is a direct, asynchronous DMA, often 2x faster. Pinning is slow
(`cudaHostAlloc` costs ~ms) and pinned memory is taken from the OS, so buffers are kept and reused by
size, under a byte cap, evicting the least recently used free buffer first.

Without CUDA there is nothing to pin: the pool hands out ordinary buffers with `is_pinned` False (and
`pool.pinned` False with `pool.reason`), so code written for GPUs runs unchanged on a CPU box.

When a request does not fit (every pooled byte is in use, or the request alone exceeds the capacity),
`on_full` decides. `"unpooled"` (the default) serves it from a buffer outside the pool, freed on release and
counted in `stats.overflows`: a training step should not fail because its staging buffers are momentarily
all in use, and an extra buffer costs one allocation (and a pin), not a crash. `"raise"` (the seed's
behaviour) raises `CommError` instead (naming the capacity and the request; a full staging pool fails a
communication, and callers catch one type for those), for code that must keep pinned memory strictly bounded.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Sequence

import torch

from .errors import CommError

_ALIGN = 512  # round requests up so near sizes share buffers


@dataclasses.dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    overflows: int = 0  # requests served outside the cap (everything in use), freed on release


class PinnedBuffer:
    """A handle on one pool buffer; use as a context manager (released on exit) or call `release()`."""

    def __init__(self, pool: "PinnedBufferPool", storage: torch.Tensor, pooled: bool):
        self._pool, self._storage, self._pooled = pool, storage, pooled
        self.released = False

    @property
    def nbytes(self) -> int:
        return self._storage.numel()

    @property
    def is_pinned(self) -> bool:
        return bool(self._storage.is_pinned()) if self._pool.pinned else False

    def view(self, shape: Sequence[int] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The buffer's first bytes as a tensor of `shape` and `dtype` (shares the buffer's memory)."""
        numel = 1
        for s in shape:
            numel *= int(s)
        need = numel * torch.empty((), dtype=dtype).element_size()
        if need > self.nbytes:
            raise ValueError(f"PinnedBuffer.view: shape {tuple(shape)} {dtype} needs {need} bytes but the buffer "
                             f"holds {self.nbytes}; acquire a larger buffer")
        if self.released:
            raise ValueError("PinnedBuffer.view: this buffer was released back to its pool")
        return self._storage[:need].view(dtype).view(tuple(int(s) for s in shape))

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._pool._release(self._storage, self._pooled)

    def __enter__(self) -> "PinnedBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


ON_FULL = ("unpooled", "raise")


class PinnedBufferPool:
    """Host staging buffers up to `capacity_bytes` in total, reused by (rounded) size, LRU-evicted.

    `pin=None` pins when CUDA is available; `pin=True` without CUDA is refused with a clear error. `on_full`
    says what a request that does not fit gets (module docstring): `"unpooled"` or `"raise"`.
    """

    def __init__(self, capacity_bytes: int = 256 << 20, pin: bool | None = None, on_full: str = "unpooled"):
        if capacity_bytes <= 0:
            raise ValueError(f"PinnedBufferPool: capacity_bytes must be > 0, got {capacity_bytes}")
        if on_full not in ON_FULL:
            raise ValueError(f"PinnedBufferPool: on_full must be one of {', '.join(map(repr, ON_FULL))}, "
                             f"got {on_full!r}")
        self.on_full = on_full
        cuda = torch.cuda.is_available()
        if pin and not cuda:
            raise ValueError("PinnedBufferPool: pin=True needs CUDA (torch.cuda.is_available() is False); "
                             "use pin=None to fall back to ordinary buffers")
        self.pinned = cuda if pin is None else bool(pin)
        self.reason = "" if self.pinned else ("CUDA is not available: buffers are ordinary pageable memory"
                                              if not cuda else "pinning disabled (pin=False)")
        self.capacity_bytes = int(capacity_bytes)
        self.stats = PoolStats()
        self._free_order: collections.OrderedDict[int, tuple[int, torch.Tensor]] = collections.OrderedDict()
        self._in_use_bytes = 0
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        """Bytes held in free (reusable) buffers."""
        return sum(size for size, _ in self._free_order.values())

    @property
    def in_use_bytes(self) -> int:
        return self._in_use_bytes

    def acquire(self, nbytes: int) -> PinnedBuffer:
        """A buffer of at least `nbytes`: a free one of the same rounded size if any, else a new one."""
        if nbytes < 0:
            raise ValueError(f"PinnedBufferPool.acquire: nbytes must be >= 0, got {nbytes}")
        size = max(_ALIGN, -(-int(nbytes) // _ALIGN) * _ALIGN)
        if size > self.capacity_bytes and self.on_full == "raise":
            raise CommError(f"PinnedBufferPool.acquire: {nbytes} bytes exceed the pool's capacity of "
                             f"{self.capacity_bytes} bytes; create the pool with a larger capacity_bytes, or "
                             f"with on_full='unpooled' to serve such requests outside the pool")
        with self._lock:
            for key, (s, storage) in self._free_order.items():
                if s == size:
                    del self._free_order[key]
                    self.stats.hits += 1
                    self._in_use_bytes += size
                    return PinnedBuffer(self, storage, True)
            pooled = self._in_use_bytes + size <= self.capacity_bytes
            if not pooled and self.on_full == "raise":
                raise CommError(
                    f"PinnedBufferPool.acquire: the pool is full: {self._in_use_bytes} of {self.capacity_bytes} "
                    f"bytes are in use and {nbytes} more were asked for; release buffers when done (`with "
                    f"pool.acquire(n) as buf:`), give the pool a larger capacity_bytes, or make it with "
                    f"on_full='unpooled'")
            self.stats.misses += 1
            while self._free_order and self._in_use_bytes + self.free_bytes + size > self.capacity_bytes:
                self._free_order.popitem(last=False)
                self.stats.evictions += 1
            if not pooled:
                self.stats.overflows += 1
            else:
                self._in_use_bytes += size
        storage = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        return PinnedBuffer(self, storage, pooled)

    def _release(self, storage: torch.Tensor, pooled: bool) -> None:
        if not pooled:
            return
        with self._lock:
            self._in_use_bytes -= storage.numel()
            self._free_order[id(storage)] = (storage.numel(), storage)  # most recently used at the end

    def clear(self) -> None:
        """Drop every free buffer (buffers in use stay valid)."""
        with self._lock:
            self._free_order.clear()


def staged_copy(tensor: torch.Tensor, device: torch.device | str, pool: PinnedBufferPool) -> torch.Tensor:
    """`tensor` on `device`, copied through a pool buffer (host -> device: pinned source, async DMA;
    device -> host: into a pinned buffer, then into a fresh tensor so the buffer can be reused)."""
    device = torch.device(device)
    nbytes = tensor.numel() * tensor.element_size()
    with pool.acquire(nbytes) as buf:
        staging = buf.view(tensor.shape, tensor.dtype)
        if device.type == "cpu":
            staging.copy_(tensor, non_blocking=pool.pinned)
            if tensor.is_cuda:
                torch.cuda.current_stream(tensor.device).synchronize()
            return staging.clone()
        staging.copy_(tensor)
        out = staging.to(device, non_blocking=pool.pinned)
        if pool.pinned:  # the buffer goes back to the pool: the DMA must have read it first
            torch.cuda.current_stream(device).synchronize()
        return out


def measure_h2d_bandwidth(nbytes: int = 64 << 20, iters: int = 10) -> dict[str, float]:
    """Host-to-device GB/s from pinned and from pageable memory (median of `iters`), on the current GPU.

    Needs CUDA; raises RuntimeError without it. (Written for a lent GPU; not run on the CPU development box.)
    """
    if not torch.cuda.is_available():
        raise RuntimeError("measure_h2d_bandwidth: needs CUDA, and torch.cuda.is_available() is False")
    dev = torch.device("cuda", torch.cuda.current_device())
    target = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out = {}
    for name, pin in (("pinned", True), ("pageable", False)):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        times = []
        for _ in range(iters + 1):
            torch.cuda.synchronize(dev)
            start = time.perf_counter()
            target.copy_(src, non_blocking=pin)
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - start)
        times = sorted(times[1:])
        out[name] = nbytes / times[len(times) // 2] / 1e9
    out["ratio"] = out["pinned"] / out["pageable"]
    return out
