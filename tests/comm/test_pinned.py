"""PinnedBufferPool: cap, reuse by size, LRU eviction, context-manager handles, and no crash without CUDA."""
from __future__ import annotations

import pytest
import torch

from tpkit.comm import PinnedBufferPool
from tpkit.comm.pinned import measure_h2d_bandwidth, staged_copy

cuda = torch.cuda.is_available()


def test_without_cuda_buffers_are_ordinary_and_say_so():
    pool = PinnedBufferPool(1 << 20)
    with pool.acquire(1000) as buf:
        assert buf.is_pinned is cuda and pool.pinned is cuda
        t = buf.view((10, 25), torch.float32)
        t.fill_(3.0)
        assert t.shape == (10, 25) and float(t.sum()) == 750.0
    if not cuda:
        assert "CUDA is not available" in pool.reason
        with pytest.raises(ValueError, match="pin=True needs CUDA"):
            PinnedBufferPool(1 << 20, pin=True)
        with pytest.raises(RuntimeError, match="needs CUDA"):
            measure_h2d_bandwidth(1 << 20)


def test_reuse_by_size():
    pool = PinnedBufferPool(1 << 20, pin=False)
    with pool.acquire(4000) as a:
        first = a.view((1000,), torch.float32).data_ptr()
    with pool.acquire(3900) as b:  # rounds to the same 4096-byte size: the same memory comes back
        assert b.view((975,), torch.float32).data_ptr() == first
    with pool.acquire(8192) as c:  # a different size: a new buffer
        assert c.view((2048,), torch.float32).data_ptr() != first
    assert (pool.stats.hits, pool.stats.misses) == (1, 2)
    with pool.acquire(4096) as a, pool.acquire(4096) as b:  # both in use: the second is new
        assert a.view((1,), torch.uint8).data_ptr() != b.view((1,), torch.uint8).data_ptr()


def test_cap_and_lru_eviction():
    pool = PinnedBufferPool(10 * 1024, pin=False)
    for size in (1024, 2048, 3072):
        pool.acquire(size).release()
    assert pool.free_bytes == 6144 and pool.in_use_bytes == 0
    pool.acquire(1024).release()  # 1024 becomes the most recently used
    with pool.acquire(7168) as big:  # needs room: evicts 2048 (least recently used), then 3072, keeps 1024
        assert pool.stats.evictions == 2 and pool.free_bytes == 1024
        assert pool.in_use_bytes == 7168 and big.nbytes == 7168
        with pool.acquire(4000) as spill:  # evicts 1024, still over the cap: served outside the pool
            assert pool.stats.evictions == 3 and pool.stats.overflows == 1 and spill.nbytes == 4096
    assert pool.in_use_bytes == 0 and pool.free_bytes == 7168
    with pytest.raises(ValueError, match="exceed the pool's capacity of 10240 bytes"):
        pool.acquire(20000)


def test_handles_refuse_misuse():
    pool = PinnedBufferPool(4096, pin=False)
    buf = pool.acquire(100)
    with pytest.raises(ValueError, match=r"needs 1024 bytes but the buffer holds 512"):
        buf.view((256,), torch.float32)
    buf.release()
    buf.release()  # idempotent
    assert pool.in_use_bytes == 0
    with pytest.raises(ValueError, match="was released"):
        buf.view((4,), torch.uint8)
    with pytest.raises(ValueError, match="capacity_bytes must be > 0"):
        PinnedBufferPool(0)


def test_staged_copy_round_trip_on_the_cpu():
    pool = PinnedBufferPool(1 << 20, pin=False)
    x = torch.randn(17, 3)
    y = staged_copy(x, "cpu", pool)
    assert torch.equal(x, y) and y.data_ptr() != x.data_ptr() and pool.in_use_bytes == 0
