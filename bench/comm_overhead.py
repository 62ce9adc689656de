"""Overhead of tpkit's collectives over the raw torch.distributed calls, on gloo with 2 local processes.

Both sides run on the same process group with the same input. The raw side is what a user would write to
get the same result: `dist.all_reduce(t)` in place (tpkit must copy, since it never modifies its input),
and `all_gather_into_tensor` / `reduce_scatter_tensor` into a freshly allocated output (tpkit returns a new
tensor). Sizes are the bytes of the full tensor (the all_reduce input, the all_gather output, the
reduce_scatter input), as in nccl-tests. Each round times a batch of calls; rounds alternate raw/tpkit in
ABBA order so drift on a shared machine hits both sides alike; every figure is the median over rounds of
the slower rank's time per call.

    python bench/comm_overhead.py [--rounds 15] [--sizes 4K,64K,1M,16M] [--markdown-out FILE]
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


def _calls(op: str, comm, full: torch.Tensor):
    """(raw, tpkit) zero-argument callables computing the same result for `op` on `full`."""
    import torch.distributed as dist

    pg, n = comm.process_group, comm.world_size
    if op == "all_reduce":
        inplace = full.clone()
        return (lambda: dist.all_reduce(inplace, group=pg)), (lambda: comm.all_reduce(full))
    if op == "all_gather":
        shard = full[: full.numel() // n].clone()

        def raw_gather():
            out = torch.empty(shard.numel() * n, dtype=shard.dtype)
            dist.all_gather_into_tensor(out, shard, group=pg)
            return out
        return raw_gather, (lambda: comm.all_gather(shard))

    def raw_scatter():
        out = torch.empty(full.numel() // n, dtype=full.dtype)
        dist.reduce_scatter_tensor(out, full, group=pg)
        return out
    return raw_scatter, (lambda: comm.reduce_scatter(full))


def _time_batch(fn, iters: int, comm) -> float:
    """Seconds per call of `fn` on the slower rank (ranks start together after a barrier)."""
    comm.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    return float(comm.all_reduce(elapsed, op="max"))


def measure(sizes: list[int], rounds: int) -> list[dict]:
    """Runs on every rank (module-level so `tpkit.launch` can start it in processes)."""
    import warnings

    import tpkit

    warnings.filterwarnings("ignore", category=FutureWarning)
    comm = tpkit.get_communicator()
    torch.manual_seed(comm.rank)
    rows = []
    for size in sizes:
        full = torch.randn(size // 4)
        iters = max(2, min(50, (4 << 20) // size))
        for op in OPS:
            raw, ours = _calls(op, comm, full)
            for fn in (raw, ours):  # warm up: connections, allocator, first-call paths
                _time_batch(fn, 2, comm)
            times = {"raw": [], "tpkit": []}
            for r in range(rounds):
                order = (("raw", raw), ("tpkit", ours)) if r % 2 == 0 else (("tpkit", ours), ("raw", raw))
                for name, fn in order:
                    times[name].append(_time_batch(fn, iters, comm))
            raw_s, ours_s = statistics.median(times["raw"]), statistics.median(times["tpkit"])
            rows.append({"op": op, "bytes": size, "raw_us": raw_s * 1e6, "tpkit_us": ours_s * 1e6,
                         "ratio": ours_s / raw_s})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| op | size | raw torch.distributed (us) | tpkit (us) | ratio tpkit/raw |",
             "|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['op']} | {format_size(row['bytes'])} | {row['raw_us']:.1f} | {row['tpkit_us']:.1f} | "
                     f"{row['ratio']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds per (op, size); median")
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated sizes, e.g. 4K,64K,16M")
    parser.add_argument("--markdown-out", help="also write the table to this file")
    args = parser.parse_args(argv)

    import tpkit

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows = tpkit.launch(measure, 2, backend="gloo", args=(sizes, args.rounds), timeout=300)[0]
    table = markdown(rows)
    header = (f"tpkit {tpkit.__version__}, torch {torch.__version__}, gloo, 2 processes, "
              f"{platform.node()} ({platform.processor() or platform.machine()}), "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, rounds={args.rounds}")
    print(header)
    print(table)
    worst = max((r["ratio"] for r in rows if r["bytes"] >= 64 << 10), default=float("nan"))
    print(f"\nworst ratio from 64 KiB up: {worst:.3f} (target <= 1.05)")
    if args.markdown_out:
        with open(args.markdown_out, "w") as f:
            f.write(header + "\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
