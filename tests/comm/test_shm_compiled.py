"""The compiled shared-memory all-reduce (`comm/shm_reduce.c`): every rank gets bitwise the sum torch computes in
rank order, whatever the values (signed zeros, subnormals, infinities, rounding ties in bf16), on 2 and 3 ranks; a
rank that arrives late hands the wait to Python and the call resumes where it stopped; the Python steps and the
compiled ones take turns on one segment."""
from __future__ import annotations

import time

import pytest
import torch

import tpkit
from tpkit.comm import ReduceOp
from tpkit.quant import native

pytestmark = pytest.mark.slow  # starts processes

DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _values(rank: int, dtype: torch.dtype, count: int) -> torch.Tensor:
    """Rank `rank`'s tensor: random values of every magnitude and the awkward ones, the same on every process."""
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(count, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-30, 30, (count,),
                                                                                        generator=g).double())
    special = [0.0, -0.0, float("inf"), -float("inf"), 1e-310, -1e-310, 1e-40, 1.0, 2 ** -8, 3 * 2 ** -9, 65504.0]
    x[:len(special)] = torch.tensor(special, dtype=torch.float64)
    return x.to(dtype)


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0] + parts[1]
    for part in parts[2:]:
        out = out + part
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    view = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(a[~nan].view(view), b[~nan].view(view))


def _sums_body(count: int) -> dict:
    comm = tpkit.get_communicator()
    n, r = comm.world_size, comm.rank
    comm.barrier()
    channel = comm._shm
    out = {"compiled": channel is not None and channel._reduce is not None}
    for dtype in DTYPES:
        mine = _values(r, dtype, count)
        want = _rank_order_sum([_values(p, dtype, count) for p in range(n)])
        got = comm.all_reduce(mine)
        inplace = mine.clone()
        comm.all_reduce_(inplace)
        out[str(dtype)] = _same_bits(got, want) and _same_bits(inplace, want) and torch.equal(
            mine.view(torch.uint8), _values(r, dtype, count).view(torch.uint8))
        # the same call through Python's steps, on the same segment, right after the compiled ones
        compiled, channel._reduce = channel._reduce, None
        try:
            out[f"{dtype} python"] = _same_bits(comm.all_reduce(mine), want)
        finally:
            channel._reduce = compiled
    # A late rank: the compiled wait runs out of spins and Python's loop finishes it, then C resumes.
    if r == n - 1:
        time.sleep(0.2)
    late = comm.all_reduce(torch.full((7,), float(r + 1)))
    out["late"] = late.tolist() == [n * (n + 1) / 2] * 7
    # A barrier is the compiled all-reduce of no elements: it waits for every rank like a barrier.
    if r == 1:
        time.sleep(0.3)
    start = time.perf_counter()
    comm.barrier()
    out["barrier waits"] = r == 1 or time.perf_counter() - start > 0.25
    # MAX and the other ops stay on torch's reduction (the compiled code only adds).
    x = torch.tensor([1.0, -2.0]) * (r + 1)
    out["max"] = comm.all_reduce(x, ReduceOp.MAX).tolist() == [float(n), -2.0]
    # After `close` the segment is unmapped: the channel stops handing its address to C.
    comm.barrier()
    channel.close()
    out["closed"] = channel._reduce is None
    return out


@pytest.mark.parametrize("world_size, count", [(2, 1024), (3, 333)])
def test_compiled_sum_is_torch_rank_order_sum_bitwise(world_size, count):
    for res in tpkit.launch(_sums_body, world_size, backend="gloo", args=(count,), timeout=120):
        assert res.pop("compiled") == native.available(), res
        assert all(res.values()), res


def test_an_unwritable_cache_leaves_python_steps_not_an_error(monkeypatch, tmp_path):
    """A read-only cache directory (a container's HOME): no compiled sum, and shared memory still connects."""
    from tpkit.comm import shm

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("TPKIT_CACHE", str(blocked / "cache"))
    assert native.compile_library(shm._REDUCE_SOURCE) is None
    monkeypatch.setattr(shm, "_REDUCE", [])
    assert shm._compiled_reduce() is None
    monkeypatch.setenv("TPKIT_NATIVE_ISA", "no-such-isa")
    monkeypatch.setattr(shm, "_REDUCE", [])
    assert shm._compiled_reduce() is None
