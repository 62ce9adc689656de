"""Communicator lifetime: `close()` and `with` release what a communicator holds (its group, its shared-memory
mapping, its worker thread, a wrapper's staging buffers); a closed communicator refuses every operation with a
CommError naming it; `barrier(async_op=True)` returns a Handle. The backend-independent checks are in
matrix.py (`check_lifetime`, run on threads, gloo and mpi); these are the backend-specific releases."""
from __future__ import annotations

import pytest
import torch

import tpkit
from tpkit.comm import (AlgorithmCommunicator, CommError, CommProfiler, CommunicationOptimizer, Handle,
                        PinnedBufferPool, create_communicator, run_threads)

from .matrix import Checker, check_lifetime


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_lifetime_checks_on_threads(world_size):
    def body(comm):
        c = Checker(f"threads rank {comm.rank}")
        check_lifetime(comm, c)
        return c.failures

    failures = [f for rank_failures in run_threads(body, world_size) for f in rank_failures]
    assert not failures, "\n".join(failures)


def test_closing_a_thread_rank_drops_its_group_and_worker():
    def body(comm):
        out = comm.all_reduce(torch.ones(2), async_op=True)  # starts the worker thread
        out.wait()
        worker = comm._executor
        comm.close()
        return worker is not None and worker._shutdown, comm._executor, comm._state, comm.closed

    for shut_down, executor, state, closed in run_threads(body, 2):
        assert shut_down and executor is None and state is None and closed


def test_wrappers_close_what_they_wrap_and_keep_their_records():
    def body(comm):
        pool = PinnedBufferPool(1 << 20, pin=False)
        results = {}
        for name, make in (("profiler", lambda c: CommProfiler(c)),
                           ("algorithm", lambda c: AlgorithmCommunicator(c, "ring")),
                           ("optimizer", lambda c: CommunicationOptimizer(c, algorithm="builtin")),
                           ("optimizer with a pool", lambda c: CommunicationOptimizer(c, pool=pool))):
            inner = comm.new_group(list(range(comm.world_size)))
            with make(inner) as wrapped:
                wrapped.all_reduce(torch.ones(4))
                if hasattr(wrapped, "pool"):
                    wrapped.pool.acquire(1000).release()  # a free buffer the pool keeps
                    free_before = wrapped.pool.free_bytes
            try:
                wrapped.all_reduce(torch.ones(4))
                error = ""
            except CommError as exc:
                error = str(exc)
            results[name] = {"inner_closed": inner.closed, "error": error,
                             "records": len(wrapped.records) if hasattr(wrapped, "records") else None,
                             "pool": (free_before, wrapped.pool.free_bytes) if hasattr(wrapped, "pool") else None}
        return results

    for results in run_threads(body, 2):
        for name, r in results.items():
            assert r["inner_closed"], name
            assert r["error"].startswith("all_reduce: ") and "is closed" in r["error"], (name, r["error"])
        assert results["profiler"]["records"] == 1 and results["optimizer"]["records"] == 1
        assert results["optimizer"]["pool"] == (1024, 0)  # its own pool: emptied
        assert results["optimizer with a pool"]["pool"] == (1024, 1024)  # the caller's pool: left alone


def test_create_communicator_in_a_with_block():
    with create_communicator("threads", profile=True) as comm:
        assert torch.equal(comm.all_reduce(torch.ones(3)), torch.ones(3))
        handle = comm.barrier(async_op=True)
        assert isinstance(handle, Handle) and handle.wait() is None and handle.is_completed()
    assert comm.closed and comm.inner.closed
    with pytest.raises(CommError, match=r"^barrier: .* is closed"):
        comm.barrier()
    assert [r.op for r in comm.records] == ["all_reduce"]


def _gloo_body():
    import torch.distributed as dist

    from tpkit.comm.torch_backend import _LOCAL_GROUPS

    world = tpkit.get_communicator()
    c = Checker(f"gloo rank {world.rank}")
    check_lifetime(world, c)
    out = {"failures": c.failures}
    # a world-made subgroup: its shared-memory mapping and its process group go with it
    sub = world.new_group(list(range(world.world_size)))
    sub.all_reduce(torch.ones(4))  # connects shared memory
    channel, group = sub._shm, sub.process_group
    out["shm_before"] = bool(channel) and not channel.closed
    handle = sub.barrier(async_op=True)
    out["async_barrier"] = isinstance(handle, Handle) and handle.wait() is None
    sub.close()
    out["shm_after"] = channel.closed
    try:
        dist.get_process_group_ranks(group)
        out["group_destroyed"] = False
    except Exception:  # noqa: BLE001 - torch raises for a destroyed group
        out["group_destroyed"] = True
    # member-made subgroups are shared by communicators asking for the same ranks: the last close destroys
    pair = world.new_group([0, 1])
    if pair is not None:
        a, b = pair.new_group([0, 1]), pair.new_group([0, 1])
        key = tuple(a._local_key)
        a.close()
        out["kept_while_used"] = key in _LOCAL_GROUPS and torch.equal(b.all_reduce(torch.ones(1)), torch.full((1,), 2.0))
        b.close()
        out["destroyed_at_last"] = key not in _LOCAL_GROUPS
        pair.close()
    world.barrier()
    out["world_works"] = torch.equal(world.all_reduce(torch.ones(1)), torch.full((1,), float(world.world_size)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_lifetime_on_gloo_processes(world_size):
    results = tpkit.launch(_gloo_body, world_size, backend="gloo", timeout=60)
    for rank, r in enumerate(results):
        assert not r["failures"], "\n".join(r["failures"])
        assert r["shm_before"] and r["shm_after"] and r["async_barrier"] and r["group_destroyed"], r
        assert r["world_works"], r
        if rank < 2:
            assert r["kept_while_used"] and r["destroyed_at_last"], r
