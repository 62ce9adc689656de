"""How far two calibrations of this machine, one right after the other, disagree (issue 56 item 4).

A profile is only as good as its rates are stable: a pick between two setups 10% apart means nothing when the rates
behind them move 20% between calibrations. This runs `calibrate_profile` `--runs` times (quick unless `--full`),
saves each profile, and compares every number the profiles hold, leaf by leaf, as the relative difference
|a - b| / max(|a|, |b|) between the first run and each later one. Leaves are grouped by what they are (the
MachineRates field: gemm tables, bandwidths, collectives, framework terms, quantized products, skew, ...); per group
the median and the largest difference and where the largest was. Counts (ranks, threads, sizes) are skipped.
What the differences do to a price: Llama shapes drawn from `--seed` (hidden, layers) priced by each profile at
world 1 and 2, training steps and decode tokens (`tpkit.estimate_speed`), the later profile's figure over the first's.

    PYTHONPATH=src python bench/calibration_spread.py [--runs 2] [--full] [--out /tmp/spread] [--json out.json]
                                                      [--seed 7] [--shapes 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

SKIP = {"ranks", "threads", "format", "world_sizes", "quick", "devices"}  # counts and settings, not rates


def leaves(data, path: str = "") -> dict[str, float]:
    """Every number in `data` (nested dicts / lists from a profile's JSON) by its path; counts in SKIP left out."""
    out: dict[str, float] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            if k not in SKIP:
                out.update(leaves(v, f"{path}/{k}"))
    elif isinstance(data, list):
        if len(data) == 2 and all(isinstance(v, (int, float)) for v in data) and isinstance(data[0], int):
            out[f"{path}[{data[0]}]"] = float(data[1])  # a (size, rate) row of a table: keyed by its size
        else:
            for i, v in enumerate(data):
                out.update(leaves(v, f"{path}[{i}]"))
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        out[path] = float(data)
    return out


def group_of(path: str) -> str:
    """The MachineRates field a leaf belongs to (`/machine/2/gemm[16]` -> "gemm"), else the top-level key."""
    parts = [p.split("[")[0] for p in path.strip("/").split("/")]
    if parts[0] == "machine" and len(parts) > 2:
        return parts[2]
    return parts[0]


def compare(a: dict, b: dict) -> dict[str, dict]:
    la, lb = leaves(a), leaves(b)
    groups: dict[str, list[tuple[float, str]]] = {}
    for path in sorted(la.keys() & lb.keys()):
        x, y = la[path], lb[path]
        if max(abs(x), abs(y)) == 0:
            continue
        groups.setdefault(group_of(path), []).append((abs(x - y) / max(abs(x), abs(y)), path))
    return {g: {"count": len(v), "median": statistics.median(d for d, _ in v), "max": max(v)[0], "worst": max(v)[1]}
            for g, v in sorted(groups.items())}


def prices(paths: list[str], seed: int, count: int) -> list[tuple[str, list[float]]]:
    """(shape and what, the ms of each profile) for `count` Llama shapes drawn from `seed`."""
    import random

    import torch
    import transformers

    import tpkit

    rng, rows = random.Random(seed), []
    for _ in range(count):
        hidden, layers = rng.choice([256, 512, 768, 1024, 1536]), rng.choice([2, 4, 6, 8])
        cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                                       num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                       num_key_value_heads=hidden // 128, vocab_size=8000)
        for mode, batch, seq in (("training", 4, 128), ("decode", 1, 128)):
            est = [tpkit.estimate_speed(cfg, [1, 2], mode=mode, batch_size=batch, seq_len=seq, dtype=torch.float32,
                                        profile=p) for p in paths]
            for world in (1, 2):
                rows.append((f"h{hidden} x {layers} {mode} tp{world}", [e.row(world).total_s * 1e3 for e in est]))
    return rows


def main() -> int:
    from tpkit.estimate.calibrate import calibrate_profile
    from tpkit.estimate.profile import save_profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--full", action="store_true", help="the full calibration (default: --quick's)")
    ap.add_argument("--out", default=None, help="directory for the profiles (default: a temporary one)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--seed", type=int, default=7, help="draws the shapes priced by each profile")
    ap.add_argument("--shapes", type=int, default=3)
    ap.add_argument("--reuse", action="store_true", help="compare the profiles already in --out (no calibration)")
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="tpkit-spread-")
    os.makedirs(out, exist_ok=True)
    profiles, paths = [], []
    for i in range(args.runs):
        if args.reuse:
            paths.append(os.path.join(out, f"profile{i + 1}.json"))
            with open(paths[-1]) as f:
                profiles.append(json.load(f))
            continue
        began, load = time.perf_counter(), os.getloadavg()[0]
        path = save_profile(calibrate_profile(quick=not args.full), os.path.join(out, f"profile{i + 1}.json"))
        print(f"calibration {i + 1}: {time.perf_counter() - began:.0f} s (load average {load:.1f} -> "
              f"{os.getloadavg()[0]:.1f}), {path}", flush=True)
        paths.append(path)
        with open(path) as f:
            profiles.append(json.load(f))
    report = {f"1 vs {i + 1}": compare(profiles[0], p) for i, p in enumerate(profiles[1:], 1)}
    for name, groups in report.items():
        print(f"\n{'quick' if not args.full else 'full'} calibrations {name}: relative difference per leaf, by group")
        print(f"  {'group':22s} {'leaves':>6s} {'median':>8s} {'max':>8s}  worst leaf")
        for g, r in groups.items():
            print(f"  {g:22s} {r['count']:6d} {r['median']:8.1%} {r['max']:8.1%}  {r['worst']}")
    rows = prices(paths, args.seed, args.shapes)
    print(f"\nprices of Llama shapes drawn from seed {args.seed} (ms), each profile, later / first")
    for what, ms in rows:
        print(f"  {what:32s} " + "  ".join(f"{m:9.2f}" for m in ms) + "  " +
              "  ".join(f"{m / ms[0]:.3f}" for m in ms[1:]))
    ratios = [abs(m / ms[0] - 1) for _, ms in rows for m in ms[1:]]
    print(f"  price difference: median {statistics.median(ratios):.1%}, max {max(ratios):.1%}")
    report["prices"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
