"""The `torch` backend on real gloo processes started by `tpkit.launch`.

Each process launch costs seconds (every process imports torch), so one launch per world size runs the
whole matrix and sends its failures back. The failure scenarios mostly wait for a timeout, so they start in
the background when this module starts (fixture `failure_runs`) and are judged by the last test.
"""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import tpkit
from tpkit.comm import CommError

from .matrix import Checker, check_groups, check_seed_helpers, run_matrix

pytestmark = pytest.mark.slow
TIMEOUT = 10.0


@pytest.fixture(scope="module", autouse=True)
def failure_runs(tmp_path_factory):
    """Start the 'die' and 'sleep' scenarios (see `_peer_failure_body`) now; yield their futures and folder."""
    out_dir = tmp_path_factory.mktemp("gloo-failures")

    def run(mode):
        try:
            return tpkit.launch(_peer_failure_body, 3, backend="gloo", args=(mode, 2, str(out_dir)), timeout=TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - judged by the test
            return exc

    with ThreadPoolExecutor(2) as pool:
        yield {mode: pool.submit(run, mode) for mode in ("die", "sleep")}, out_dir


def _matrix_body():
    comm = tpkit.get_communicator()
    failures, count = run_matrix(comm, "gloo")
    c = Checker(f"gloo seed helpers rank {comm.rank}")
    check_seed_helpers(c, "gloo")
    return failures + c.failures, count + c.count, comm.backend, comm.torch_backend


@pytest.mark.parametrize("world_size", [2, 3])
def test_op_matrix(world_size):
    results = tpkit.launch(_matrix_body, world_size, backend="gloo", timeout=60)
    failures = [f for rank_failures, *_ in results for f in rank_failures]
    assert not failures, "\n".join(failures[:20])
    assert all(r[2:] == ("torch", "gloo") for r in results)
    assert min(r[1] for r in results) > 300


def _four_rank_body():
    import torch.distributed as dist

    from tpkit.comm.torch_backend import TorchCommunicator

    comm = tpkit.get_communicator()
    c = Checker(f"gloo groups rank {comm.rank}/4")
    check_groups(comm, c)  # several, overlapping and nested groups; split(comm, 2) on 4 ranks
    raw = dist.new_group([0, 1])
    if comm.rank >= 2:
        with c.raises("a communicator for a group this process is not in", ValueError, "not a member", "[0, 1]"):
            TorchCommunicator(raw)
    return c.failures, c.count


def test_groups_on_four_processes():
    results = tpkit.launch(_four_rank_body, 4, backend="gloo", timeout=60)
    failures = [f for rank_failures, _ in results for f in rank_failures]
    assert not failures, "\n".join(failures)
    assert min(count for _, count in results) > 10


def _peer_failure_body(mode: str, victim: int, out_dir: str):
    """`victim` dies (os._exit) or sleeps past the timeout in the middle of an all_reduce; every other rank
    records what it saw and how long it took."""
    comm = tpkit.get_communicator()
    comm.barrier()  # everybody is connected before the victim acts
    if comm.rank == victim:
        if mode == "die":
            os._exit(3)
        others = [Path(out_dir, f"{mode}-{r}.json") for r in range(comm.world_size) if r != victim]
        deadline = time.monotonic() + TIMEOUT + 5
        while not all(p.exists() for p in others) and time.monotonic() < deadline:
            time.sleep(0.05)  # wake up only once every other rank has given up on us
        raise KeyError(f"rank {comm.rank} woke up late")  # launch must re-raise this, marked with the rank
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1000))
        kind, message = "no error", ""
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        kind, message = type(exc).__name__, str(exc)
    record = {"kind": kind, "message": message, "elapsed": time.monotonic() - start}
    Path(out_dir, f"{mode}-{comm.rank}.json").write_text(json.dumps(record))
    return record


def test_peer_that_dies_or_never_arrives(failure_runs):
    """3 gloo ranks, 10 s timeout. A rank that dies: the others raise CommError at once and launch reports
    the dead rank. A rank that never arrives: the others raise CommError after the timeout, not later; its
    own exception comes back through launch with its rank."""
    futures, out_dir = failure_runs
    died, slept = futures["die"].result(), futures["sleep"].result()

    assert isinstance(died, tpkit.LaunchError) and died.rank == 2, repr(died)
    assert "rank 2 died with exit code 3" in str(died)
    assert isinstance(slept, KeyError) and slept.rank == 2, repr(slept)
    assert "woke up late" in str(slept) and any("raised on rank 2" in n for n in getattr(slept, "__notes__", []))
    for mode, low, high in (("die", 0.0, TIMEOUT), ("sleep", TIMEOUT - 1.0, TIMEOUT + 5.0)):
        for rank in (0, 1):
            record = json.loads((out_dir / f"{mode}-{rank}.json").read_text())
            assert record["kind"] == CommError.__name__, (mode, rank, record)
            assert "all_reduce" in record["message"] and "group world" in record["message"], record
            assert low <= record["elapsed"] <= high, (mode, rank, record["elapsed"])
