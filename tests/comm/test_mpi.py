"""The `mpi` backend (mpi4py) under real `mpirun -n 2` and `-n 3`: the whole op matrix in one run each."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = shutil.which("mpirun")
try:
    import mpi4py  # noqa: F401
    HAVE_MPI4PY = True
except ImportError:
    HAVE_MPI4PY = False

# `make test` installs OpenMPI and mpi4py where it can (root with apt-get); where it could not, the tests skip and
# pytest's summary (-ra) says why.
_MISSING = ("mpirun not found; install OpenMPI (apt-get install openmpi-bin libopenmpi-dev, or `make mpi`)"
            if MPIRUN is None else
            "mpi4py is not installed; pip install mpi4py (or `make mpi`)" if not HAVE_MPI4PY else None)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")]


def _mpirun_command(n: int) -> list[str]:
    version = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True).stdout
    extra = ["--oversubscribe"] if "Open MPI" in version or "OpenRTE" in version else []  # more ranks than cores
    return [MPIRUN, *extra, "-n", str(n), sys.executable, "-m", "tests.comm.mpi_worker"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_op_matrix_under_mpirun(world_size):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TP_DEBUG", None)
    proc = subprocess.run(_mpirun_command(world_size), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    summaries = re.findall(r"mpi rank (\d+)/(\d+): (\d+) checks, 0 failures", proc.stdout)
    assert sorted(int(r) for r, _, _ in summaries) == list(range(world_size)), output[-3000:]
    assert all(int(n) == world_size and int(count) > 300 for _, n, count in summaries), summaries
