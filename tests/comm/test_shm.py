"""The shared-memory transport (comm/shm.py) under a torch gloo communicator, and `all_reduce_` in place."""
from __future__ import annotations

import glob
import os
import time

import pytest
import torch

import tpkit
from tpkit.comm import CommError, ReduceOp, run_threads


def _shm_body() -> dict:
    import torch.distributed as dist

    comm = tpkit.get_communicator()
    r = comm.rank
    out = {}
    x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * r
    for op in ("sum", "max", "min", "avg", "product"):
        got = comm.all_reduce(x, op)
        want = x.clone()
        if op == "avg":
            dist.all_reduce(want)
            want /= comm.world_size
        else:
            dist.all_reduce(want, {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                                   "product": dist.ReduceOp.PRODUCT}[op])
        out[op] = torch.equal(got, want)
    out["shared_memory"] = comm.shared_memory
    out["no_segment_left"] = not glob.glob("/dev/shm/tpkit-*")
    out["input_kept"] = torch.equal(x, torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * r)
    y = x.clone()
    out["inplace_same_object"] = comm.all_reduce_(y) is y and torch.equal(y, comm.all_reduce(x))
    g = comm.all_gather(torch.full((2, 2), float(r)), dim=1)
    out["all_gather"] = torch.equal(g, torch.cat([torch.full((2, 2), float(p)) for p in range(comm.world_size)], 1))
    big = torch.ones(300_000)  # > 1 MiB: gloo
    out["big"] = torch.equal(comm.all_reduce(big), big * comm.world_size)
    for _ in range(50):  # the two banks alternate correctly over many calls
        x = comm.all_reduce(x) / comm.world_size
    out["repeat"] = x.tolist()
    os.environ["TPKIT_SHM"] = "0"
    plain = comm.new_group(list(range(comm.world_size)))
    out["off_sum"] = torch.equal(plain.all_reduce(torch.ones(4)), torch.full((4,), float(comm.world_size)))
    out["off"] = plain.shared_memory
    # A rank that never arrives: CommError after the timeout, like the other backends.
    comm._shm.timeout = 1.0
    if r == 0:
        try:
            comm.all_reduce(torch.ones(4))
            out["timeout"] = "no error"
        except CommError as exc:
            out["timeout"] = str(exc)
    else:
        time.sleep(4.0)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_shared_memory_all_reduce_gloo(world_size):
    results = tpkit.launch(_shm_body, world_size, backend="gloo", timeout=60)
    for r, res in enumerate(results):
        assert res["shared_memory"] and res["no_segment_left"] and res["input_kept"], res
        assert all(res[k] for k in ("sum", "max", "min", "avg", "product", "inplace_same_object", "all_gather",
                                    "big", "off_sum")), res
        assert res["off"] is False and res["repeat"] == results[0]["repeat"]
    assert "never arrived" in results[0]["timeout"] and "shared memory" in results[0]["timeout"]


def _inplace_threads(comm) -> bool:
    t = torch.full((3,), float(comm.rank + 1))
    same = comm.all_reduce_(t) is t
    m = torch.full((2,), float(comm.rank))
    comm.all_reduce_(m, ReduceOp.MAX)
    return same and t.tolist() == [3.0] * 3 and m.tolist() == [1.0, 1.0]


def test_all_reduce_inplace_threads():
    assert run_threads(_inplace_threads, 2) == [True, True]
