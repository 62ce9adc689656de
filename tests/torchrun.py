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


def spawn_world(script: str, *args: str, nproc: int = 2, env: dict | None = None,
                timeout: float = 120.0) -> list[tuple[int, str, float]]:
    """Start `nproc` ranks of `script` as torchrun's agent would (RANK, WORLD_SIZE, ..., the store hosted here), but
    with no agent to stop the survivors when one rank dies: `[(exit code, output, seconds until it exited)]` per
    rank. What a rank on another node sees when a peer dies."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    base = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), TORCHELASTIC_USE_AGENT_STORE="True",
                TORCHELASTIC_RESTART_COUNT="0",
                PYTHONPATH=os.pathsep.join([SRC, ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    base.pop("TPKIT_FAULTS", None)
    base.update(env or {})
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, script, *args], env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in range(nproc)]
    ended = [None] * nproc
    while any(e is None for e in ended) and time.perf_counter() - start < timeout:
        for r, p in enumerate(procs):
            if ended[r] is None and p.poll() is not None:
                ended[r] = time.perf_counter() - start
        time.sleep(0.05)
    out = []
    for r, p in enumerate(procs):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        text, _ = p.communicate()
        out.append((p.returncode if ended[r] is not None else -1, text, ended[r] if ended[r] is not None else timeout))
    del store
    return out


def assert_peers_raise_comm_error(ranks: list, killed: int, where: str, timeout: float) -> None:
    """`spawn_world`'s results when rank `killed` was killed by `TPKIT_FAULTS` at `where` (the scripts print
    "rank r: CommError after ..." on a CommError and "finished" on success): it died with SIGKILL, and every other
    rank exited 1 on a CommError within `timeout` of its death."""
    code, output, died_at = ranks[killed]
    assert code == -9 and f"killing rank {killed} at {where}" in output, output
    for rank, (code, output, exited_at) in enumerate(ranks):
        if rank != killed:
            assert code == 1 and f"rank {rank}: CommError after" in output and "finished" not in output, output
            assert exited_at - died_at < timeout, (rank, exited_at, died_at)
