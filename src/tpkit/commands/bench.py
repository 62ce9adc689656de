"""`tpkit bench`: collective benchmarks in the style of nccl-tests, per algorithm.

For each collective and size it times every requested algorithm ("builtin" = the backend's own, "auto" =
the selector's pick, or a name from `tpkit.comm.ALGORITHMS`), alternating between them call by call for
`--budget` seconds (at least `--repeats` rounds) and reporting the median (the machine may be shared;
see `tpkit.comm.timing`), and prints nccl-tests' columns: size, count, type,
redop, time (us), algbw, busbw, #wrong (elements that differ from a reference computed on every rank
from every rank's known input). Times are the slowest rank's. Runs on thread-ranks, on spawned gloo
ranks (`--backend gloo`), or on the ranks torchrun started (nccl on GPUs, else gloo; detected from RANK).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

from tpkit.tables import WIDE_HELP

COLLECTIVE_NAMES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
REDUCING = ("all_reduce", "reduce_scatter")


def parse_size(text: str) -> int:
    """`4K`, `64M`, `1G`, `512` -> bytes (binary units)."""
    t = text.strip().upper().rstrip("B").rstrip("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a byte count like 4K, 64M or 1G") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default=None, choices=["gloo", "threads", "nccl"],
                        help="gloo (default) or threads: run --world-size local ranks; under torchrun the launched "
                             "ranks are used with this process-group backend (default: nccl if CUDA, else gloo)")
    parser.add_argument("-n", "--world-size", type=int, default=2)
    parser.add_argument("-c", "--collectives", default=",".join(COLLECTIVE_NAMES),
                        help=f"comma-separated subset of {','.join(COLLECTIVE_NAMES)}")
    parser.add_argument("-a", "--algorithms", default="builtin,auto",
                        help="comma-separated: builtin, auto, algorithm names, or 'all'")
    parser.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("4K"))
    parser.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("64M"))
    parser.add_argument("-f", "--step-factor", type=int, default=4, help="size multiplier between rows (default 4)")
    parser.add_argument("--iters", type=int, default=1, help="back-to-back calls per timed sample at 1 MiB and "
                        "below, fewer above (default 1: every sample is one call started by a barrier)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="at least this many alternating rounds per size")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of alternating rounds per collective "
                        "and size (rounds = max(--repeats, budget / one round)); the median is reported")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16", "int32",
                                                                "int64"])
    parser.add_argument("-o", "--op", default="sum", help="reduce op: sum, avg, max, min, product")
    parser.add_argument("--calibration-budget", type=float, default=8.0, help="seconds for calibrating auto")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="auto without calibrating the cost model first (MPICH thresholds)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON ('-' for stdout)")
    parser.add_argument("--plot", metavar="PNG", help="busbw against size, one line per algorithm (matplotlib)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--wide", action="store_true", help=WIDE_HELP + "; nccl-tests' fixed columns")
    parser.add_argument("--timeout", type=float, default=600.0)


# -- per rank ---------------------------------------------------------------------------------------
def rank_input(count: int, rank: int, dtype):
    """Rank `rank`'s input: small integers (exact in every dtype, products included)."""
    import torch

    values = (torch.arange(count, dtype=torch.int64) * 7 + rank * 3) % 5 - 2
    return values.to(dtype)


def _reference(collective: str, count: int, n: int, rank: int, op, dtype):
    import torch

    from tpkit.comm.algorithms import combine
    from tpkit.comm.ops import ReduceOp, divide_by_count

    if collective == "broadcast":
        return rank_input(count, 0, dtype)
    if collective == "all_gather":
        return torch.cat([rank_input(count // n, r, dtype) for r in range(n)])
    acc = rank_input(count, 0, torch.float64)
    for r in range(1, n):
        combine(acc, rank_input(count, r, torch.float64), op)
    if op is ReduceOp.AVG:
        acc = divide_by_count(acc, n) if dtype.is_floating_point else torch.div(acc, n, rounding_mode="trunc")
    if collective == "reduce_scatter":
        acc = acc[rank * (count // n):(rank + 1) * (count // n)]
    return acc.to(dtype)


def _call(comm, collective: str, x, op):
    if collective == "all_reduce":
        return comm.all_reduce(x, op=op)
    if collective == "all_gather":
        return comm.all_gather(x)
    if collective == "reduce_scatter":
        return comm.reduce_scatter(x, op=op)
    return comm.broadcast(x, src=0)


def iterations(iters: int, nbytes: int) -> int:
    """`iters` up to 1 MiB, then proportionally fewer (at least 1): large sizes take long enough."""
    return max(1, min(iters, iters * (1 << 20) // max(1, nbytes)))


def bench_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """The benchmark on this rank (a launched rank, a thread-rank or a torchrun rank); every rank returns the
    same rows (times are the maximum over ranks)."""
    import torch

    import tpkit
    from tpkit.comm import ALGORITHMS, AlgorithmCommunicator, AlgorithmSelector, ReduceOp
    from tpkit.comm.timing import interleaved_times

    comm = tpkit.get_communicator()
    n, rank = comm.world_size, comm.rank
    dtype = getattr(torch, cfg["dtype"])
    op = ReduceOp.parse(cfg["op"])
    device = torch.device("cuda", torch.cuda.current_device()) if getattr(comm, "torch_backend", "") == "nccl" \
        else torch.device("cpu")
    sizes, size = [], cfg["min_bytes"]
    while size <= cfg["max_bytes"]:
        sizes.append(size)
        size *= cfg["step_factor"]
    selector = AlgorithmSelector()
    calib_s = 0.0
    if "auto" in cfg["algorithms"] and not cfg["no_calibrate"] and n > 1:
        # calibrate where the benchmark runs: up to 5 of its sizes, the smallest and largest included
        picks = sorted({round(i * (len(sizes) - 1) / 4) for i in range(5)})
        start = time.perf_counter()
        selector.calibrate(comm, sizes=[sizes[i] for i in picks], budget_s=cfg["calibration_budget"], iters=2)
        calib_s = time.perf_counter() - start
    wrapped = {}
    for name in cfg["algorithms"]:
        wrapped[name] = comm if name == "builtin" else AlgorithmCommunicator(
            comm, name if name == "auto" else {c: name for c in ALGORITHMS if name in ALGORITHMS[c]}, selector)
    plan = [(c, s, [a for a in cfg["algorithms"] if a in ("builtin", "auto") or a in ALGORITHMS[c]])
            for c in cfg["collectives"] for s in sizes]
    progress = _progress(rank == 0 and cfg["progress"], len(plan))
    rows, times = [], []
    itemsize = torch.empty((), dtype=dtype).element_size()
    for collective, nbytes, algs in plan:
        count = max(n, nbytes // itemsize)
        count -= count % n
        x = rank_input(count // n if collective == "all_gather" else count, rank, dtype).to(device)
        ref = _reference(collective, count, n, rank, op, dtype).to(device)
        iters = iterations(cfg["iters"], count * itemsize)
        chosen: dict[str, str] = {}
        notes: dict[str, str] = {}
        wrong: dict[str, int] = {}
        for a in algs:  # correctness first, outside the timings
            out = _call(wrapped[a], collective, x, op)
            wrong[a] = int((out != ref).sum().item()) if out.shape == ref.shape else ref.numel()
            chosen[a] = getattr(wrapped[a], "last_algorithm", "builtin")
            settle = 2 * getattr(wrapped[a], "verify", 0) if a == "auto" else 0  # auto's verification calls
            for _ in range(cfg["warmup"] + settle):
                _call(wrapped[a], collective, x, op)
            chosen[a] = getattr(wrapped[a], "last_algorithm", "builtin")
            notes[a] = getattr(wrapped[a], "last_note", "")
        samples = interleaved_times(comm, [lambda c=wrapped[a]: _call(c, collective, x, op) for a in algs],
                                    cfg["budget"], cfg["repeats"], iters=iters, sync=lambda: _sync(device))
        for a, runs in zip(algs, samples):
            times.append(statistics.median(runs))
            rows.append({"collective": collective, "algorithm": a, "chosen": chosen[a], "bytes": count * itemsize,
                         "count": count, "type": cfg["dtype"], "redop": op.value if collective in REDUCING else "none",
                         "iters": iters, "samples": len(runs), "wrong": wrong[a], "note": notes[a]})
        progress.advance()
    progress.close()
    # one all-reduce at the end: the slowest rank's time, and every rank's wrong count summed
    t = comm.all_reduce(torch.tensor(times, dtype=torch.float64, device=device), op=ReduceOp.MAX).cpu().tolist()
    w = comm.all_reduce(torch.tensor([r["wrong"] for r in rows], dtype=torch.int64, device=device)).cpu().tolist()
    from tpkit.comm.profiler import bus_factor

    for row, seconds, bad in zip(rows, t, w):
        algbw = row["bytes"] / seconds / 1e9
        row.update(time_us=seconds * 1e6, algbw=algbw, busbw=algbw * bus_factor(row["collective"], n), wrong=bad)
    return {"world_size": n, "rank": rank, "rows": rows, "calibration_s": calib_s,
            "model": selector.model.to_dict() if selector.model.calibrated else None}


def _sync(device) -> None:
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


class _NoProgress:
    def advance(self) -> None: ...

    def close(self) -> None: ...


class _RichProgress:
    def __init__(self, total: int):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._p = Progress(TextColumn("tpkit bench"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                           TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        self._task = self._p.add_task("bench", total=total)
        self._p.start()

    def advance(self) -> None:
        self._p.advance(self._task)

    def close(self) -> None:
        self._p.stop()


def _progress(show: bool, total: int):
    if not show:
        return _NoProgress()
    try:
        return _RichProgress(total)
    except Exception:  # noqa: BLE001 - a progress bar is never worth failing a benchmark
        return _NoProgress()


# -- output -----------------------------------------------------------------------------------------
# nccl-tests' columns: (header, width, align, drop, cell). `drop` > 0: left out, highest first, when the output is a
# terminal too narrow for the row (type and redop then move into each block's header line).
_COLUMNS = (
    ("size", 11, ">", 0, lambda r: str(r["bytes"])),
    ("count", 10, ">", 4, lambda r: str(r["count"])),
    ("type", 8, ">", 5, lambda r: r["type"]),
    ("redop", 7, ">", 3, lambda r: r["redop"]),
    ("algorithm", 30, "<", 0, lambda r: r["algorithm"] + (f" -> {r['chosen']}" if r["algorithm"] == "auto" else "")),
    ("time(us)", 11, ">", 0, lambda r: f"{r['time_us']:.1f}"),
    ("algbw(GB/s)", 11, ">", 2, lambda r: f"{r['algbw']:.3f}"),
    ("busbw(GB/s)", 11, ">", 0, lambda r: f"{r['busbw']:.3f}"),
    ("#wrong", 6, ">", 0, lambda r: str(r["wrong"])),
    ("vs builtin", 10, ">", 1, lambda r: r["vs builtin"]),
)


def format_table(result: dict[str, Any], backend: str, width: int | None = None) -> str:
    """nccl-tests-like text: one block per collective, one row per (size, algorithm), with time vs builtin.

    `width=None` (`--wide`) gives nccl-tests' fixed columns; a width (a terminal's, or 100 when piped) gives columns
    as wide as their contents, leaving out count, type, redop, algbw and "vs builtin" (in that order) until a row
    fits."""
    from tpkit.tables import wrap_text

    n = result["world_size"]
    by_key = {(r["collective"], r["bytes"], r["algorithm"]): r for r in result["rows"]}
    rows = []
    for r in result["rows"]:
        base = by_key.get((r["collective"], r["bytes"], "builtin"))
        rows.append(dict(r, **{"vs builtin": f"{base['time_us'] / r['time_us']:.2f}x"
                               if base and r["algorithm"] != "builtin" else ""}))
    cells = [[cell(r) for *_, cell in _COLUMNS] for r in rows]
    if width is None:
        keep = list(range(len(_COLUMNS)))
        widths = [w for _, w, *_ in _COLUMNS]
    else:
        widths = [max([len(header), *(len(c[i]) for c in cells)]) for i, (header, *_) in enumerate(_COLUMNS)]
        keep = list(range(len(_COLUMNS)))
        for i in sorted((i for i in keep if _COLUMNS[i][3]), key=lambda i: -_COLUMNS[i][3]):
            if 2 + sum(widths[j] for j in keep) + len(keep) - 1 <= width:
                break
            keep.remove(i)

    def line(values: list[str], first: str = " ") -> str:
        return (first + " " + " ".join(f"{values[i]:{_COLUMNS[i][2]}{widths[i]}}" for i in keep)).rstrip()

    lines = [wrap_text(f"tpkit bench: {n} {backend} rank(s); time = median of alternating repeats, slowest rank",
                       width, "# ", "#   ")]
    if result.get("model"):
        m = result["model"]
        lines.append(wrap_text(f"cost model calibrated in {result['calibration_s']:.1f}s: alpha {m['alpha'] * 1e6:.1f}"
                               f" us, beta {m['beta'] * 1e9:.3f} ns/B, gamma {m['gamma'] * 1e9:.3f} ns/B",
                               width, "# ", "#   "))
    moved = [i for i in (2, 3) if i not in keep]  # type, redop: said once per block instead
    current = None
    for r, c in zip(rows, cells):
        if r["collective"] != current:
            current = r["collective"]
            lines.append(f"#\n# {current}" + (f" ({', '.join(c[i] for i in moved)})" if moved else ""))
            lines.append(line([header for header, *_ in _COLUMNS], "#"))
        lines.append(line(c))
    wrong = sum(r["wrong"] for r in result["rows"])
    lines.append(f"# out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    return "\n".join(lines)


def plot_busbw(result: dict[str, Any], path: str, title: str = "") -> None:
    """busbw against size (log2 axis), one line per algorithm, one panel per collective."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    collectives = list(dict.fromkeys(r["collective"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(collectives), figsize=(4.2 * len(collectives), 3.6), squeeze=False)
    for ax, col in zip(axes[0], collectives):
        rows = [r for r in result["rows"] if r["collective"] == col]
        for alg in dict.fromkeys(r["algorithm"] for r in rows):
            pts = [(r["bytes"], r["busbw"]) for r in rows if r["algorithm"] == alg]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=alg)
        ax.set_xscale("log", base=2)
        ax.set_title(col)
        ax.set_xlabel("bytes")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or f"tpkit bench, {result['world_size']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    from tpkit.comm import ALGORITHMS
    from tpkit.comm.ops import ReduceOp

    collectives = [c.strip() for c in args.collectives.split(",") if c.strip()]
    bad = [c for c in collectives if c not in COLLECTIVE_NAMES]
    if bad or not collectives:
        raise ValueError(f"tpkit bench: unknown collectives {bad}; valid: {','.join(COLLECTIVE_NAMES)}")
    known = sorted({a for c in collectives for a in ALGORITHMS[c]})
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if algorithms == ["all"]:
        algorithms = ["builtin", "auto", *known]
    bad = [a for a in algorithms if a not in ("builtin", "auto", *known)]
    if bad or not algorithms:
        raise ValueError(f"tpkit bench: unknown algorithms {bad} for {','.join(collectives)}; valid: builtin, auto, "
                         f"{', '.join(known)}, or all")
    ReduceOp.parse(args.op)
    if args.min_bytes > args.max_bytes:
        raise ValueError(f"tpkit bench: --min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}")
    if args.step_factor < 2 or args.iters < 1 or args.repeats < 1 or args.world_size < 1 or args.budget < 0:
        raise ValueError("tpkit bench: need --step-factor >= 2, --iters >= 1, --repeats >= 1, --world-size >= 1, "
                         "--budget >= 0")
    return {"collectives": collectives, "algorithms": algorithms, "min_bytes": args.min_bytes,
            "max_bytes": args.max_bytes, "step_factor": args.step_factor, "iters": args.iters,
            "warmup": args.warmup, "repeats": args.repeats, "budget": args.budget, "dtype": args.dtype, "op": args.op,
            "no_calibrate": args.no_calibrate, "calibration_budget": args.calibration_budget,
            "progress": not args.no_progress and sys.stderr.isatty()}


def run(args: argparse.Namespace) -> int:
    import tpkit

    try:
        cfg = _config(args)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        if args.backend == "threads":
            print("tpkit bench: --backend threads makes its own ranks; run it without torchrun", file=sys.stderr)
            return 2
        tpkit.init(args.backend)
        result = bench_rank(cfg)
        backend_name = getattr(tpkit.get_communicator(), "torch_backend", "torch")
        if result["rank"] != 0:
            return 1 if any(r["wrong"] for r in result["rows"]) else 0
    else:
        if args.backend == "nccl":
            print("tpkit bench: --backend nccl needs torchrun (one process per GPU): "
                  "torchrun --nproc-per-node=N -m tpkit.cli bench", file=sys.stderr)
            return 2
        backend_name = args.backend or "gloo"
        result = tpkit.launch(bench_rank, args.world_size, backend=backend_name, args=(cfg,),
                              timeout=args.timeout)[0]
    result.update(backend=backend_name, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  machine=f"{platform.node()} {os.cpu_count()} cpus", config=cfg)
    if args.json == "-":
        print(json.dumps(result, indent=1))
    else:
        from tpkit.tables import output_width

        print(format_table(result, backend_name, output_width(wide=args.wide)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    if args.plot:
        plot_busbw(result, args.plot, f"tpkit bench: {result['world_size']} {backend_name} ranks")
        print(f"plot written to {os.path.abspath(args.plot)}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 1 if any(r["wrong"] for r in result["rows"]) else 0

