"""Issue 5: CommProfiler overhead on a 1 MiB all_reduce over gloo (target <= 5%).

Plain, profiled and plain-again calls alternate (each after a barrier, so ranks start together), many
times. On a shared box the per-call times are bimodal (a rank descheduled or not), so the figure is the
10th percentile (the undisturbed cost) as well as the median, on the slowest rank, and the plain-vs-plain
pair shows the noise floor. The profiler's own cost per call without communication (threads, world size
1) is printed for scale.

    python bench/comm_profiler_overhead.py [--world-size 2] [--rounds 300]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import tpkit
from tpkit.comm import CommProfiler, create_communicators
from tpkit.comm.timing import interleaved_times, slowest_rank_medians


def _p10(values: list[float]) -> float:
    return sorted(values)[len(values) // 10]


def _body(rounds: int) -> dict[str, list[float]]:
    comm = tpkit.get_communicator()
    prof = CommProfiler(comm)
    x = torch.randn(1 << 18)  # 1 MiB of float32
    calls = [lambda: comm.all_reduce(x), lambda: prof.all_reduce(x), lambda: comm.all_reduce(x)]
    samples = interleaved_times(comm, calls, budget_s=0, min_rounds=rounds, max_rounds=rounds)
    low = comm.all_reduce(torch.tensor([_p10(s) for s in samples], dtype=torch.float64), op="max").tolist()
    return {"median": slowest_rank_medians(comm, samples), "p10": low}


def _bare_cost(calls: int = 20000) -> float:
    """Seconds the profiler adds per call around a world-of-one all_reduce (no communication)."""
    comm = create_communicators(1)[0]
    prof = CommProfiler(comm, max_records=calls)
    x = torch.ones(4)
    out = []
    for target in (comm, prof, comm, prof):
        start = time.perf_counter()
        for _ in range(calls):
            target.all_reduce(x)
        out.append((time.perf_counter() - start) / calls)
    return statistics.mean(out[1::2]) - statistics.mean(out[0::2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    result = tpkit.launch(_body, args.world_size, args=(args.rounds,), timeout=300)[0]
    for stat, (plain, profiled, again) in result.items():
        print(f"gloo x{args.world_size}, 1 MiB all_reduce, {args.rounds} rounds, {stat}: plain {plain * 1e3:.3f} ms, "
              f"profiled {profiled * 1e3:.3f} ms, overhead {profiled / plain - 1:+.1%} "
              f"(plain again vs plain, the noise floor: {again / plain - 1:+.1%})")
    print(f"profiler cost without communication: {_bare_cost() * 1e6:.1f} us per call")


if __name__ == "__main__":
    main()
