"""Issue 5 benchmark: `tpkit bench` on gloo at world sizes 2, 3, 4, builtin vs auto, plus cost-model accuracy.

Runs `tpkit bench -n N -a builtin,auto` (calibrated auto; builtin and auto alternate, median of repeats,
slowest rank) for each world size, writes the JSON and a busbw plot per world size, and prints the
markdown for BENCHMARKS.md: builtin / auto time ratios per collective and size, the targets (auto never
more than 5% slower than builtin at world sizes 3 and 4; reduce_scatter >= 1.3x from 1 MiB), and how far
the calibrated model's predictions are from the measured times (target: within 25% from 64 KiB).

    python bench/comm_toolkit.py [--world-sizes 2,3,4] [--max-bytes 64M] [--out bench/results]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tpkit.cli import main as tpkit_main
from tpkit.comm.cost_model import CostModel


def human(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.0f} {unit}"
    return f"{n} B"


def analyse(result: dict) -> tuple[list[str], dict]:
    n = result["world_size"]
    model = CostModel.from_dict(result["model"])
    rows = {(r["collective"], r["bytes"], r["algorithm"]): r for r in result["rows"]}
    collectives = list(dict.fromkeys(r["collective"] for r in result["rows"]))
    sizes = sorted({r["bytes"] for r in result["rows"] if r["collective"] == "all_reduce"})
    lines = [f"| collective | " + " | ".join(human(s) for s in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    worst, rs_min, errors, formula_errors = 10.0, 10.0, [], []
    for col in collectives:
        cells = []
        for s in sorted({r["bytes"] for r in result["rows"] if r["collective"] == col}):
            b, a = rows[(col, s, "builtin")], rows[(col, s, "auto")]
            ratio = b["time_us"] / a["time_us"]
            worst = min(worst, ratio)
            if col == "reduce_scatter" and s >= (1 << 20):
                rs_min = min(rs_min, ratio)
            cells.append(f"{ratio:.2f}x {a['chosen'].replace('recursive_', 'rec_')}")
            if s >= (64 << 10):
                for r, alg in ((b, "builtin"), (a, a["chosen"])):
                    pred = model.predict(col, alg, r["bytes"], n)
                    errors.append((abs(pred - r["time_us"] * 1e-6) / (r["time_us"] * 1e-6), col, alg, s))
                    if alg != "builtin":
                        pred = model.formula(col, alg, r["bytes"], n)
                        formula_errors.append(abs(pred - r["time_us"] * 1e-6) / (r["time_us"] * 1e-6))
        lines.append(f"| {col} | " + " | ".join(cells) + " |")
    errors.sort(reverse=True)
    within = sum(e <= 0.25 for e, *_ in errors)
    summary = {"world_size": n, "worst_ratio": worst, "reduce_scatter_min_from_1MiB": rs_min,
               "model_within_25pct": f"{within}/{len(errors)}",
               "model_median_error": errors[len(errors) // 2][0] if errors else 0.0,
               "model_worst": errors[0] if errors else None, "model": result["model"],
               "formula_within_25pct": f"{sum(e <= 0.25 for e in formula_errors)}/{len(formula_errors)}",
               "formula_median_error": sorted(formula_errors)[len(formula_errors) // 2] if formula_errors else 0.0}
    return lines, summary


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,3,4")
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--repeats", default="5")
    parser.add_argument("--budget", default="2")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--plots", default="docs")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.plots, exist_ok=True)
    report = [f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; gloo on loopback, "
              f"{os.cpu_count()} cores shared with other jobs at the time."]
    for n in [int(w) for w in args.world_sizes.split(",")]:
        path = os.path.join(args.out, f"bench_gloo{n}.json")
        cmd = ["bench", "-n", str(n), "-a", "builtin,auto", "-b", "4K", "-e", args.max_bytes, "-f", "4",
               "--repeats", args.repeats, "--budget", args.budget, "--no-progress", "--json", path,
               "--plot", os.path.join(args.plots, f"busbw_gloo{n}.png")]
        print("tpkit " + " ".join(cmd), file=sys.stderr)
        start = time.perf_counter()
        code = tpkit_main(cmd)
        with open(path) as f:
            result = json.load(f)
        lines, summary = analyse(result)
        m = summary["model"]
        report += ["", f"**{n} ranks** (`tpkit {' '.join(cmd[:-4])}`, {time.perf_counter() - start:.0f} s, "
                   f"exit {code}): builtin time / auto time, and auto's pick",
                   "", *lines, "",
                   f"worst auto vs builtin: {summary['worst_ratio']:.2f}x; reduce_scatter from 1 MiB: "
                   f"{summary['reduce_scatter_min_from_1MiB']:.2f}x at least; calibrated alpha "
                   f"{m['alpha'] * 1e6:.0f} us, beta {m['beta'] * 1e9:.2f} ns/B, gamma {m['gamma'] * 1e9:.2f} ns/B; "
                   f"model predictions within 25% of measured (>= 64 KiB, builtin and auto's pick): "
                   f"{summary['model_within_25pct']}, median error {summary['model_median_error']:.0%}; "
                   f"alpha-beta-gamma formula alone for auto's non-builtin picks: {summary['formula_within_25pct']}, "
                   f"median error {summary['formula_median_error']:.0%}"]
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(run())
