"""The eager call path of a small all-reduce stays lean: no per-call objects beyond the result, a barrier that
stays in shared memory, and little time above the shared-memory transport (bench/shm_allreduce.py measures
it on two processes; this bounds it in one, where nothing else can move the figure)."""
from __future__ import annotations

import pytest
import torch

import tpkit

pytestmark = pytest.mark.slow  # each test starts processes


def _objects_per_call() -> dict:
    import torch.distributed as dist

    from tpkit.comm import errors, handle

    comm = tpkit.get_communicator()
    x = torch.full((1024,), float(comm.rank + 1))
    comm.all_reduce(x)  # connects shared memory
    counts = {"Handle": 0, "_Guard": 0, "gloo all_reduce": 0}
    real_init, real_completed, real_guard = handle.Handle.__init__, handle.Handle.completed, errors.Guard.__init__
    real_dist_all_reduce = dist.all_reduce

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    handle.Handle.__init__ = counted("Handle", real_init)
    handle.Handle.completed = classmethod(counted("Handle", real_completed.__func__))
    errors.Guard.__init__ = counted("_Guard", real_guard)
    dist.all_reduce = counted("gloo all_reduce", real_dist_all_reduce)
    try:
        outs = [comm.all_reduce(x) for _ in range(20)]
        scratch = [x.clone() for _ in range(20)]
        for t in scratch:
            comm.all_reduce_(t)
        counts["objects"] = counts["Handle"] + counts["_Guard"]  # of the 40 collectives
        for _ in range(5):
            comm.barrier()
    finally:
        handle.Handle.__init__, handle.Handle.completed = real_init, real_completed
        errors.Guard.__init__ = real_guard
        dist.all_reduce = real_dist_all_reduce
    want = torch.full((1024,), 3.0)
    counts["right"] = (all(torch.equal(o, want) for o in outs + scratch)
                       and torch.equal(x, torch.full((1024,), float(comm.rank + 1))))  # the input is kept
    counts["shared_memory"] = comm.shared_memory
    return counts


def test_small_synchronous_calls_make_no_handle_guard_or_gloo_round_trip():
    for counts in tpkit.launch(_objects_per_call, 2, backend="gloo", timeout=60):
        assert counts["shared_memory"] and counts["right"], counts
        assert counts["objects"] == 0, counts  # 40 collectives: nothing allocated but their results
        assert counts["gloo all_reduce"] == 0, counts  # the barrier stayed in shared memory


def _overhead_us(tries: int) -> list[tuple[float, float]]:
    """(transport, comm.all_reduce) in us: best per-call time of many batches, alternating, in one process whose
    shared-memory channel sees its one peer as always arrived (so only this process's own work is timed)."""
    import os
    import time

    from tpkit.comm import ReduceOp, shm
    from tpkit.comm.torch_backend import TorchCommunicator

    torch.set_num_threads(1)
    comm = TorchCommunicator()
    path = f"/dev/shm/tpkit-test-{os.getpid()}"
    size = shm._FLAGS_BYTES + 2 * 2 * shm.SLOT_BYTES
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)
    channel = shm.SharedMemoryChannel(path, size, 0, 2, 10.0, [os.getpid()] * 2, "test")
    os.unlink(path)
    channel._flags[shm._Q] = channel._flags[shm._Q + 1] = 1 << 62  # the peer: arrived and done, always
    comm._shm, comm._world_size = channel, 2
    x = torch.randn(1024)  # 4 KiB
    calls = {"transport": lambda: channel.all_reduce(x, ReduceOp.SUM), "comm": lambda: comm.all_reduce(x)}
    results = []
    for _ in range(tries):
        best = {name: float("inf") for name in calls}
        for _ in range(30):
            for name, call in calls.items():
                start = time.perf_counter()
                for _ in range(200):
                    call()
                best[name] = min(best[name], (time.perf_counter() - start) / 200 * 1e6)
        results.append((best["transport"], best["comm"]))
    channel.close()
    return results


def test_call_path_costs_little_above_the_transport():
    # Before the lean path: ~4 us above a ~4.5 us transport on the Intel Xeon (1.9x); now ~0.8 there (1.2x), and
    # 2.1-2.5 us above 6.4-6.8 on the AMD EPYC (1.33-1.36x, under a CI run's load), whose Python costs more per
    # call. So the bound is a ratio to the transport, which the old path's 1.9x exceeds: the best of three tries, as
    # a real overhead shows in all of them.
    tries = tpkit.launch(_overhead_us, 1, backend="gloo", args=(3,), timeout=120)[0]
    assert any(ours <= 1.5 * bare for bare, ours in tries), f"(transport us, comm.all_reduce us) per try: {tries}"
