"""PinnedBufferPool: cap, reuse by size, LRU eviction, on_full modes, context-manager handles, no crash without CUDA;
staging through it, synchronous and async."""
from __future__ import annotations

import pytest
import torch

from tpkit.comm import CommError, Handle, PinnedBufferPool
from tpkit.comm.optimizer import StagingCommunicator
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
    # on_full="unpooled" (the default): larger than the whole pool, still served, outside it; the free buffers
    # are evicted first (as for the spill above), so the pinned memory held stays near the cap
    with pool.acquire(20000) as oversize:
        assert oversize.nbytes == 20480 and pool.stats.overflows == 2 and pool.in_use_bytes == 0
        oversize.view((5000,), torch.float32).fill_(1.0)
    assert pool.free_bytes == 0 and pool.stats.evictions == 4  # and it is not kept after its release


def test_on_full_raise_refuses_what_does_not_fit_with_a_comm_error():
    pool = PinnedBufferPool(8192, pin=False, on_full="raise")
    with pytest.raises(CommError, match="20000 bytes exceed the pool's capacity of 8192 bytes.*on_full='unpooled'"):
        pool.acquire(20000)
    with pool.acquire(6000) as held:
        with pytest.raises(CommError, match=r"pool is full: 6144 of 8192 bytes are in use and 4000 more"):
            pool.acquire(4000)
        assert pool.stats.overflows == 0 and pool.in_use_bytes == held.nbytes == 6144
    with pool.acquire(4000):  # released: fits again
        assert pool.in_use_bytes == 4096
    with pytest.raises(ValueError, match="on_full must be one of 'unpooled', 'raise', got 'grow'"):
        PinnedBufferPool(8192, on_full="grow")


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


class _StageEverything(StagingCommunicator):
    """Stages CPU tensors too (through CPU buffers), so the staging path runs on a machine without a GPU."""

    def needs_staging(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor)


def test_async_calls_stage_through_the_pool_as_sync_calls_do():
    from tpkit.comm import run_threads

    def body(comm):
        pool = PinnedBufferPool(1 << 20, pin=False)
        staged = _StageEverything(comm, pool)
        x = torch.arange(6.0).view(2, 3) + comm.rank
        uses = []
        results = []
        for async_op in (False, True):
            before = pool.stats.hits + pool.stats.misses + pool.stats.overflows
            calls = [lambda a: staged.all_reduce(x, async_op=a), lambda a: staged.all_gather(x, dim=1, async_op=a),
                     lambda a: staged.reduce_scatter(x, async_op=a), lambda a: staged.broadcast(x, src=1, async_op=a)]
            outs = [call(async_op) for call in calls]
            if async_op:
                assert all(isinstance(h, Handle) for h in outs)
                outs = [h.wait() for h in outs]
            results.append(outs)
            uses.append(pool.stats.hits + pool.stats.misses + pool.stats.overflows - before)
        want = [comm.all_reduce(x), comm.all_gather(x, dim=1), comm.reduce_scatter(x), comm.broadcast(x, src=1)]
        same = all(torch.equal(a, b) and torch.equal(a, w) for a, b, w in zip(results[0], results[1], want))
        return uses, same, pool.in_use_bytes

    for uses, same, in_use in run_threads(body, 2):
        assert uses == [8, 8], uses  # in and out for each of the 4 calls, synchronous or not
        assert same and in_use == 0


def test_only_tensors_on_another_kind_of_device_are_staged():
    from tpkit.comm import create_communicators

    staged = StagingCommunicator(create_communicators(1)[0], PinnedBufferPool(1 << 16, pin=False))
    assert staged.device.type == "cpu" and not staged.needs_staging(torch.ones(2))
    assert staged.needs_staging(torch.ones(2, device="meta"))


@pytest.mark.skipif(not cuda, reason="needs a GPU: a CUDA tensor staged to a CPU backend and back")
def test_cuda_tensor_on_a_cpu_backend_round_trips_async():
    from tpkit.comm import create_communicators

    pool = PinnedBufferPool(1 << 20)
    staged = StagingCommunicator(create_communicators(1)[0], pool)
    x = torch.randn(64, device="cuda")
    handle = staged.all_reduce(x, async_op=True)
    out = handle.wait()
    assert out.is_cuda and torch.equal(out, x) and pool.stats.misses >= 1
