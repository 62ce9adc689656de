"""Latency of a small all-reduce between 2 local gloo processes: tpkit's shared-memory transport vs gloo.

Each process runs `comm.all_reduce(t)` (shared memory, picked automatically) and `dist.all_reduce(t)` (gloo's
own path on the same process group) on a float32 tensor of `--bytes`, after a warm-up; the figure is the
median of `--iters` calls, timed one by one.

    python bench/shm_allreduce.py [--bytes 4096] [--iters 2000] [--world-size 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _body(nbytes: int, iters: int) -> dict:
    import torch.distributed as dist

    import tpkit

    comm = tpkit.get_communicator()
    t = torch.randn(nbytes // 4)
    out = {}
    for name, fn in (("tpkit_shm", lambda: comm.all_reduce(t)),
                     ("tpkit_shm_inplace", lambda: comm.all_reduce_(t.clone())),
                     ("gloo", lambda: dist.all_reduce(t.clone()))):
        for _ in range(100):
            fn()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e6
    out["shared_memory"] = comm.shared_memory
    return out


def main() -> None:
    import tpkit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--world-size", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    results = tpkit.launch(_body, a.world_size, backend="gloo", args=(a.bytes, a.iters))
    r = results[0]
    print(f"{a.bytes} B all-reduce, {a.world_size} gloo processes, median of {a.iters}: "
          f"tpkit shm {r['tpkit_shm']:.1f} us, shm in place {r['tpkit_shm_inplace']:.1f} us, "
          f"gloo {r['gloo']:.1f} us (gloo / shm = {r['gloo'] / r['tpkit_shm']:.1f}x; shm active: "
          f"{r['shared_memory']})")


if __name__ == "__main__":
    main()
