"""Overhead of tpkit's collectives over the raw torch.distributed calls, on gloo with 2 local processes.

Both sides run on the same process group with the same input. The raw side is what a user would write to
get the same result: `dist.all_reduce(t)` in place (tpkit must copy, since it never modifies its input),
and `all_gather_single` / `reduce_scatter_single` (formerly `*_into_tensor` / `*_tensor`) into a freshly
allocated output (tpkit returns a new
tensor). Sizes are the bytes of the full tensor (the all_reduce input, the all_gather output, the
reduce_scatter input), as in nccl-tests. Calls alternate one by one between raw and tpkit (the order
rotating every sample), each timed alone; the headline is the median over samples of tpkit's time divided by
the raw call's time right beside it, which cancels the slow changes of a shared machine's load.

    python bench/comm_overhead.py [--samples 400] [--sizes 4K,64K,1M,16M] [--markdown-out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

SIZES = ["4K", "16K", "64K", "256K", "1M", "4M", "16M"]
OPS = ["all_reduce", "all_gather", "reduce_scatter"]


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def format_size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def _calls(op: str, comm, full: torch.Tensor) -> dict:
    """Zero-argument callables for `op` on `full`: `raw` (the torch.distributed call), `tpkit`, and for
    all_reduce `raw+copy` (the raw call on a fresh copy: the same out-of-place result tpkit returns)."""
    import torch.distributed as dist

    # the current names where torch has them (the old ones warn on every call, which would flatter tpkit)
    all_gather_raw = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_raw = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    pg, n = comm.process_group, comm.world_size
    if op == "all_reduce":
        inplace = full.clone()

        def raw_copy():
            out = full.clone()
            dist.all_reduce(out, group=pg)
            return out
        return {"raw": lambda: dist.all_reduce(inplace, group=pg), "tpkit": lambda: comm.all_reduce(full),
                "raw+copy": raw_copy}
    if op == "all_gather":
        shard = full[: full.numel() // n].clone()

        def raw_gather():
            out = torch.empty(shard.numel() * n, dtype=shard.dtype)
            all_gather_raw(out, shard, group=pg)
            return out
        return {"raw": raw_gather, "tpkit": lambda: comm.all_gather(shard)}

    def raw_scatter():
        out = torch.empty(full.numel() // n, dtype=full.dtype)
        reduce_scatter_raw(out, full, group=pg)
        return out
    return {"raw": raw_scatter, "tpkit": lambda: comm.reduce_scatter(full)}


def measure(sizes: list[int], samples: int) -> list[dict]:
    """Runs on every rank (module-level so `tpkit.launch` can start it in processes).

    Calls alternate one by one, in an order that rotates every sample, each timed on its own, so a slow
    spell of the shared machine hits every side alike; medians drop the spells. Rank 0's clock is used: a
    collective ends at about the same time on both ranks.
    """
    import warnings

    import tpkit

    warnings.filterwarnings("ignore", category=FutureWarning)
    comm = tpkit.get_communicator()
    torch.manual_seed(comm.rank)
    clock = time.perf_counter
    rows = []
    for size in sizes:
        full = torch.randn(size // 4)
        count = max(40, min(samples, (256 << 20) // (size * 4)))
        for op in OPS:
            calls = list(_calls(op, comm, full).items())
            for _ in range(2):  # warm up: connections, allocator, first-call paths
                for _, fn in calls:
                    fn()
            comm.barrier()
            times: dict[str, list[float]] = {name: [] for name, _ in calls}
            for i in range(count):
                shift = i % len(calls)
                for name, fn in calls[shift:] + calls[:shift]:
                    start = clock()
                    fn()
                    times[name].append(clock() - start)
            median = {name: statistics.median(values) for name, values in times.items()}

            def pair_ratio(other: str) -> float:  # sample i of both sides ran back to back
                return statistics.median(t / o for t, o in zip(times["tpkit"], times[other]))
            rows.append({"op": op, "bytes": size, "samples": count, "raw_us": median["raw"] * 1e6,
                         "tpkit_us": median["tpkit"] * 1e6, "ratio": median["tpkit"] / median["raw"],
                         "pair_ratio": pair_ratio("raw"),
                         "copy_ratio": pair_ratio("raw+copy") if "raw+copy" in times else None})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| op | size | calls per side | raw torch.distributed (us) | tpkit (us) | ratio of medians | "
             "**median pair ratio** | pair ratio vs raw on a copy |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        copy = "" if row["copy_ratio"] is None else f"{row['copy_ratio']:.3f}"
        lines.append(f"| {row['op']} | {format_size(row['bytes'])} | {row['samples']} | {row['raw_us']:.1f} | "
                     f"{row['tpkit_us']:.1f} | {row['ratio']:.3f} | **{row['pair_ratio']:.3f}** | {copy} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=400,
                        help="timed calls per side and (op, size) at most (fewer for big sizes); median")
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated sizes, e.g. 4K,64K,16M")
    parser.add_argument("--markdown-out", help="also write the table to this file")
    args = parser.parse_args(argv)

    import tpkit

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows = tpkit.launch(measure, 2, backend="gloo", args=(sizes, args.samples), timeout=300)[0]
    table = markdown(rows)
    header = (f"tpkit {tpkit.__version__}, torch {torch.__version__}, gloo, 2 processes, "
              f"{platform.node()} ({platform.processor() or platform.machine()}), "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, up to {args.samples} alternating calls per side")
    print(header)
    print(table)
    worst = max((r["pair_ratio"] for r in rows if r["bytes"] >= 64 << 10), default=float("nan"))
    print(f"\nworst median pair ratio from 64 KiB up: {worst:.3f} (target <= 1.05)")
    if args.markdown_out:
        with open(args.markdown_out, "w") as f:
            f.write(header + "\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
