"""The `threads` backend: the whole op matrix on 1, 2, 3, 4 and 6 thread-ranks, groups, failures, logging."""
from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import tpkit
from tpkit.comm import CommError, run_threads, split

from .matrix import Checker, check_seed_helpers, run_matrix

TIMEOUT = 10.0


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
def test_op_matrix(world_size):
    results = run_threads(lambda comm: run_matrix(comm, "threads"), world_size, timeout=60)
    failures = [f for rank_failures, _ in results for f in rank_failures]
    assert not failures, "\n".join(failures[:20])
    assert min(count for _, count in results) > 300  # the matrix really ran


def test_split_layout_four_ranks_tp2():
    def body(comm):
        tp, dp = split(comm, 2)
        return tp.name, dp.name, tp.all_gather(torch.tensor([comm.rank])).tolist()

    assert run_threads(body, 4) == [("world[0, 1]", "world[0, 2]", [0, 1]), ("world[0, 1]", "world[1, 3]", [0, 1]),
                                    ("world[2, 3]", "world[0, 2]", [2, 3]), ("world[2, 3]", "world[1, 3]", [2, 3])]


def test_split_layout_six_ranks_tp3():
    def body(comm):
        tp, dp = split(comm, 3)
        return tp.all_gather(torch.tensor([comm.rank])).tolist(), dp.all_gather(torch.tensor([comm.rank])).tolist()

    results = run_threads(body, 6)
    assert [tp for tp, _ in results] == [[0, 1, 2]] * 3 + [[3, 4, 5]] * 3
    assert [dp for _, dp in results] == [[0, 3], [1, 4], [2, 5]] * 2


def test_split_rejects_a_tp_size_that_does_not_divide():
    with pytest.raises(ValueError, match=r"tp_size 4 does not divide the world size 6; valid tp sizes: \[1, 2, 3, 6\]"):
        run_threads(lambda comm: split(comm, 4), 6)


def test_seed_helpers_through_launch():
    for n in (1, 2, 3, 4):
        results = tpkit.launch(_seed_body, n, backend="threads")
        failures = [f for rank_failures in results for f in rank_failures]
        assert not failures, "\n".join(failures)


def _seed_body():
    c = Checker("threads seed")
    check_seed_helpers(c, "threads")
    return c.failures


def test_peer_that_never_arrives_times_out_on_every_other_rank():
    """Rank 2 sleeps past the timeout: ranks 0 and 1 raise CommError naming the op and group, in time."""
    seen = {}

    def body(comm):
        group = comm.new_group([0, 1, 2])
        if comm.rank == 2:
            time.sleep(TIMEOUT + 0.5)
            return None
        if comm.rank == 3:
            return None
        start = time.monotonic()
        with pytest.raises(CommError) as info:
            group.all_reduce(torch.ones(3))
        seen[comm.rank] = (str(info.value), time.monotonic() - start)
        return None

    run_threads(body, 4, timeout=TIMEOUT)
    assert sorted(seen) == [0, 1]
    for message, elapsed in seen.values():
        assert "all_reduce" in message and "world[0, 1, 2]" in message and "timed out" in message, message
        assert "ranks [2] never arrived" in message
        assert TIMEOUT - 0.5 <= elapsed <= TIMEOUT + 6, elapsed


def test_rank_that_dies_aborts_its_peers_at_once_and_is_reported_with_its_rank():
    seen = {}

    def body(comm):
        if comm.rank == 1:
            raise RuntimeError("rank 1 lost its GPU")
        start = time.monotonic()
        try:
            comm.all_gather(torch.ones(2))
        except CommError as exc:
            seen[comm.rank] = (str(exc), time.monotonic() - start)
            raise

    with pytest.raises(RuntimeError, match="lost its GPU") as info:
        run_threads(body, 3, timeout=TIMEOUT)
    assert info.value.rank == 1
    assert sorted(seen) == [0, 2]
    for message, elapsed in seen.values():
        assert "all_gather" in message and "group world" in message and "rank 1 failed" in message, message
        assert elapsed < TIMEOUT / 2


def test_tp_debug_logs_each_collective(monkeypatch, caplog):
    monkeypatch.setenv("TP_DEBUG", "1")
    with caplog.at_level(logging.DEBUG, logger="tpkit"):
        run_threads(lambda comm: comm.reduce_scatter(torch.ones(4, 6, dtype=torch.bfloat16), dim=-1), 2)
    lines = [r.getMessage() for r in caplog.records if r.name == "tpkit"]
    assert any("reduce_scatter shape=(4, 6) dtype=torch.bfloat16 op=SUM dim=1 group=world rank=1/2" in line
               for line in lines), lines


def test_no_debug_logging_by_default(monkeypatch, caplog):
    monkeypatch.delenv("TP_DEBUG", raising=False)
    with caplog.at_level(logging.DEBUG, logger="tpkit"):
        run_threads(lambda comm: comm.all_reduce(torch.ones(2)), 2)
    assert not [r for r in caplog.records if r.name == "tpkit"]


def test_async_input_is_snapshotted_when_issued():
    """A thread-rank that changes its input after issuing an async op does not change the result."""
    def body(comm):
        x = torch.full((3,), float(comm.rank + 1))
        handle = comm.all_reduce(x, async_op=True)
        x.fill_(100.0)
        return handle.wait()

    for result in run_threads(body, 3):
        assert torch.equal(result, torch.full((3,), 6.0))


def test_results_are_detached_and_new():
    def body(comm):
        x = torch.ones(2, requires_grad=True)
        out = [comm.all_reduce(x), comm.all_gather(x), comm.broadcast(x), comm.reduce_scatter(x.reshape(2, 1))]
        return [(t.requires_grad, t.data_ptr() == x.data_ptr()) for t in out]

    for n in (1, 2):
        for rank_result in run_threads(body, n):
            assert rank_result == [(False, False)] * 4


def test_ranks_run_on_distinct_threads():
    names = run_threads(lambda comm: threading.current_thread().name, 3)
    assert len(set(names)) == 3
