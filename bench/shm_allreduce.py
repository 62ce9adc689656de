"""Latency of a small all-reduce between local gloo processes: tpkit's call path over the bare shared-memory
transport, and gloo's own path for scale.

Candidates, on a float32 tensor of `--bytes` in every process:

- `transport`: the shared-memory channel itself (`comm._shm.all_reduce(t, SUM)`), what the call path sits on;
- `comm.all_reduce`: the public call (checks, TP_DEBUG switch, error wrapping, then the transport);
- `comm.all_reduce_`: the in-place form (no result allocated);
- `gloo`: `dist.all_reduce` on the same process group (a copy, as tpkit never modifies its input).

The first three alternate call by call in an order shuffled every round, every call after a barrier (so all
ranks start together), as many rounds as fit in `--budget` seconds (`tpkit.comm.timing.interleaved_times`);
gloo is timed the same way afterwards, alone (its worker threads would slow whatever runs next).
A candidate's figure is the median over rounds on each rank, then the slowest rank's; the overhead of the call
path is the median over rounds of (`comm.all_reduce` - `transport`) of the same round, slowest rank. Each of
`--runs` runs starts fresh processes; the summary is the median over runs.

`--placement` pins the ranks: `free` leaves them to the scheduler (which on a busy machine often puts both on
one core), `split` puts rank r on core r, `shared` puts every rank on core 0 (the worst case `free` can give).

    python bench/shm_allreduce.py [--bytes 4096] [--budget 3] [--runs 3] [--world-size 2]
                                  [--placement free|split|shared] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

CANDIDATES = ("transport", "comm.all_reduce", "comm.all_reduce_", "gloo")


def _body(nbytes: int, budget: float, max_rounds: int, placement: str) -> dict:
    import torch.distributed as dist

    import tpkit
    from tpkit.comm import ReduceOp
    from tpkit.comm.timing import interleaved_times

    torch.set_num_threads(1)
    comm = tpkit.get_communicator()
    if placement != "free":
        os.sched_setaffinity(0, {comm.rank % os.cpu_count() if placement == "split" else 0})
    t = torch.randn(nbytes // 4)
    scratch = torch.zeros_like(t)  # all_reduce_ of zeros stays zeros, however many calls
    comm.all_reduce(t)  # connects the shared-memory channel
    channel = comm._shm
    if not channel:
        raise RuntimeError("shared memory is not active (TPKIT_SHM=0, or ranks on different hosts)")
    calls = {"transport": lambda: channel.all_reduce(t, ReduceOp.SUM), "comm.all_reduce": lambda: comm.all_reduce(t),
             "comm.all_reduce_": lambda: comm.all_reduce_(scratch), "gloo": lambda: dist.all_reduce(t.clone())}
    for _ in range(200):  # warm-up
        for call in calls.values():
            call()
    samples = interleaved_times(comm, [calls[name] for name in CANDIDATES[:3]], budget_s=budget, min_rounds=50,
                                max_rounds=max_rounds)
    samples += interleaved_times(comm, [calls["gloo"]], budget_s=budget / 4, min_rounds=50, max_rounds=max_rounds)
    medians = [statistics.median(s) for s in samples]
    ours, bare = samples[CANDIDATES.index("comm.all_reduce")], samples[CANDIDATES.index("transport")]
    medians.append(statistics.median(a - b for a, b in zip(ours, bare)))
    slowest = comm.all_reduce(torch.tensor(medians, dtype=torch.float64), op="max").tolist()
    return {"rounds": len(samples[0]), "us": dict(zip(CANDIDATES, (m * 1e6 for m in slowest))),
            "overhead_us": slowest[-1] * 1e6}


def run(nbytes: int, budget: float, max_rounds: int, world_size: int, placement: str) -> dict:
    import tpkit

    return tpkit.launch(_body, world_size, backend="gloo", args=(nbytes, budget, max_rounds, placement),
                        timeout=120)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=3.0, help="seconds of timed rounds per run")
    ap.add_argument("--max-rounds", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=3, help="fresh launches; the summary is their median")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--placement", choices=("free", "split", "shared"), default="free")
    ap.add_argument("--json", help="also write every run's figures here")
    a = ap.parse_args(argv)
    load = os.getloadavg()[0]
    runs = [run(a.bytes, a.budget, a.max_rounds, a.world_size, a.placement) for _ in range(a.runs)]
    print(f"{a.bytes} B all-reduce, {a.world_size} gloo processes ({a.placement} placement), barrier before every "
          f"call, alternating; median over rounds, slowest rank (load average {load:.1f} -> {os.getloadavg()[0]:.1f})")
    for i, r in enumerate(runs):
        cells = ", ".join(f"{name} {r['us'][name]:.1f} us" for name in CANDIDATES)
        print(f"  run {i + 1} ({r['rounds']} rounds): {cells}; call path over transport {r['overhead_us']:.1f} us")
    med = {name: statistics.median(r["us"][name] for r in runs) for name in CANDIDATES}
    overhead = statistics.median(r["overhead_us"] for r in runs)
    print(f"median of {len(runs)} runs: comm.all_reduce {med['comm.all_reduce']:.1f} us (target <= 25), transport "
          f"{med['transport']:.1f} us, overhead {overhead:.1f} us (target <= 5), all_reduce_ "
          f"{med['comm.all_reduce_']:.1f} us, gloo {med['gloo']:.1f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bytes": a.bytes, "world_size": a.world_size, "placement": a.placement, "runs": runs}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
