"""Run under mpirun (`mpirun -n N python -m tests.comm.mpi_worker`): the whole op matrix on the `mpi`
backend plus its own failure checks. Prints one summary line per rank and exits non-zero on any failure."""
from __future__ import annotations

import sys
import time

import torch

import tpkit
from tpkit.comm import CommError

from .matrix import Checker, check_seed_helpers, run_matrix

TIMEOUT = 1.0  # short: the late rank below sleeps past it, and the whole run stays fast


def check_timeout(comm, c: Checker) -> None:
    """The last rank arrives late: every other rank raises CommError naming op and group after TIMEOUT; the
    late rank then completes the abandoned operation and the group keeps working."""
    from tpkit.comm.mpi import MPICommunicator

    short = MPICommunicator(comm.mpi_comm, timeout=TIMEOUT)  # the same MPI communicator, a shorter timeout
    if short.rank == short.world_size - 1:
        time.sleep(TIMEOUT + 1.0)
        comm.all_reduce(torch.ones(3))  # the long-timeout view: only the others are meant to time out
    else:
        start = time.monotonic()
        with c.raises("a peer that never arrives", CommError, "all_reduce", "group world", "timed out"):
            short.all_reduce(torch.ones(3))
        elapsed = time.monotonic() - start
        c.true("CommError within the timeout", TIMEOUT - 0.1 <= elapsed <= TIMEOUT + 8.0, f"after {elapsed:.2f}s")
    comm.barrier()
    c.same("the group works after the late rank arrived", comm.all_reduce(torch.ones(2)),
           torch.full((2,), float(comm.world_size)))


def check_non_member(c: Checker) -> None:
    from mpi4py import MPI

    from tpkit.comm.mpi import MPICommunicator

    with c.raises("a communicator for a group this process is not in", ValueError, "COMM_NULL"):
        MPICommunicator(MPI.COMM_NULL)


def main() -> int:
    comm = tpkit.init(backend="mpi")
    failures, count = run_matrix(comm, "mpi")
    c = Checker(f"mpi rank {comm.rank}/{comm.world_size}")
    check_seed_helpers(c, "mpi")
    c.true("tpkit.init('mpi') uses the mpi backend", comm.backend == "mpi", comm.backend)
    check_timeout(comm, c)
    check_non_member(c)
    failures += c.failures
    print(f"mpi rank {comm.rank}/{comm.world_size}: {count + c.count} checks, {len(failures)} failures", flush=True)
    for line in failures:
        print(line, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
