"""Does the setup search pick the fastest setup? Six cases on 2 local processes (one thread each: a device is a
core): decode and training, small and large hidden, with and without a memory cap that rules setups out. For
each, `tpkit.search` ranks every setup by prediction (no measuring), then every setup that fits is run for real
(`tpkit.setups.run_setup`, fresh processes, median of `--steps`), and the pick's measured time is compared with
the measured best.

    PYTHONPATH=src python bench/search.py [--profile FILE] [--steps 3] [--cases 1,2,...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from estimate_accuracy import config  # noqa: E402

# (name, architecture, hidden, layers, vocab, goal, batch, memory cap as a fraction of TP1's predicted need or None)
CASES = [("decode small", "llama", 256, 2, 8000, "decode", 1, None),
         ("decode large", "llama", 2048, 4, 8000, "decode", 1, None),
         ("decode large, capped", "llama", 2048, 4, 8000, "decode", 8, 0.75),
         ("train small", "llama", 256, 2, 8000, "train", 8, None),
         ("train large", "llama", 1024, 4, 8000, "train", 8, None),
         ("train large, capped", "llama", 1024, 4, 8000, "train", 8, 0.6)]
SEQ = 64


def main() -> None:
    from tpkit.estimate.calibrate import calibrate_profile
    from tpkit.estimate.predict import Setup, predict
    from tpkit.estimate.profile import load_profile, save_profile
    from tpkit.setups import run_setup, search

    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", default=None, help="comma-separated case numbers (1-based)")
    parser.add_argument("--json", default=None, help="write every measurement to this file")
    args = parser.parse_args()
    if args.profile and os.path.exists(args.profile):
        prof = load_profile(args.profile)
    else:
        from tpkit.setups import DP_WRAPPERS

        prof = calibrate_profile("gloo", (2,), threads=1, dp_wrappers=DP_WRAPPERS)
        if args.profile:
            save_profile(prof, args.profile)
    chosen = [int(c) for c in args.cases.split(",")] if args.cases else range(1, len(CASES) + 1)
    print("| case | candidates (fit) | picked | picked measured ms | measured best | best ms | picked / best |")
    print("|---|---|---|---|---|---|---|")
    out = []
    for i in chosen:
        name, arch, hidden, layers, vocab, goal, batch, cap = CASES[i - 1]
        cfg = config(arch, hidden, layers, vocab)
        memory = None
        if cap is not None:  # a cap that rules the whole-model setups out
            need = predict(cfg, Setup(1, 2, "ddp" if goal == "train" else "replicas"), goal, batch, SEQ, prof,
                           dtype=torch.float32).memory_bytes
            memory = cap * need
        began = time.perf_counter()
        result = search(cfg, 2, goal, memory, batch, SEQ, prof, dtype=torch.float32)
        runs = []
        for c in result.fitting:
            seconds = run_setup(cfg, c.setup, goal, batch, SEQ, steps=args.steps, threads=1, dtype=torch.float32)
            runs.append((c.setup.label(), c.prediction.seconds, seconds))
        best = min(runs, key=lambda r: r[2])
        picked = runs[0]
        out.append({"case": name, "runs": runs, "memory_cap": memory, "seconds": time.perf_counter() - began})
        print(f"| {name} | {len(result.candidates)} ({len(runs)}) | {picked[0]} | {picked[2] * 1e3:.1f} | {best[0]} | "
              f"{best[2] * 1e3:.1f} | {picked[2] / best[2]:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
