"""Run a script under real `torchrun` (the restart tests): `--standalone`, gloo on CPU, this checkout's tpkit.

`python -m torch.distributed.run` with the same interpreter, `PYTHONPATH` led by the `src/` that `tpkit` was
imported from (so the workers import this checkout), one thread per worker, and a wall-clock limit: a hang is
a failure with the output so far, not a stuck test run.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import tpkit

SRC = os.path.dirname(os.path.dirname(os.path.abspath(tpkit.__file__)))
ROOT = os.path.dirname(SRC)


def torchrun(script: str, *args: str, nproc: int = 2, max_restarts: int = 0, env: dict | None = None,
             timeout: float = 240.0) -> tuple[int, str, float]:
    """`(exit code, stdout + stderr, wall seconds)` of `torchrun --standalone --nproc-per-node N
    --max-restarts R script args`."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", TPKIT_SHM=os.environ.get("TPKIT_SHM", "1"),
                       PYTHONPATH=os.pathsep.join([SRC, ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_USE_AGENT_STORE", "TPKIT_FAULTS"):
        environment.pop(name, None)
    environment.update(env or {})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"--max-restarts={max_restarts}", "--monitor-interval=0.1", script, *args]
    start = time.perf_counter()
    # A session of its own, so that a timeout ends torchrun and every worker it started (its process group).
    proc = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code, output = -1, output + f"\n[torchrun killed after {timeout:g}s]"
    return code, output, time.perf_counter() - start
