"""How close `estimate_speed` comes to published decode figures, and what `--calibrate` measures here.

Published figures: github.com/pytorch-labs/gpt-fast README ("Tensor Parallelism"), Llama-2-7B and Llama-2-70B,
bf16, batch 1, torch.compile, 8xA100-80GB NVLink (330 W). The default profile was fitted on the 7B rows only;
the 70B rows are held out. Both layouts are shown: gpt-fast's (embedding and output replicated,
`vocab_parallel=False`) and tpkit's (vocab-parallel).

    PYTHONPATH=src python bench/estimate_accuracy.py [--calibrate] [--quick]
"""
from __future__ import annotations

import argparse

import torch

from tpkit.estimate.presets import preset_config
from tpkit.estimate.profile import DEFAULT_PROFILE
from tpkit.estimate.speed import estimate_speed

PUBLISHED = {"llama-2-7b": {1: 104.9, 2: 168.84, 4: 254.02, 8: 328.43},
             "llama-2-70b": {2: 21.32, 4: 38.01, 8: 62.50}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calibrate", action="store_true", help="also measure this machine (gloo, 2 ranks)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print("| model | TP | gpt-fast tok/s | estimate, gpt-fast layout | estimate, tpkit layout |")
    print("|---|---|---|---|---|")
    for name, rows in PUBLISHED.items():
        got = {}
        for vocab_parallel in (False, True):
            est = estimate_speed(preset_config(name), list(rows), hardware="A100-80GB", interconnect="nvlink",
                                 mode="decode", dtype=torch.bfloat16, seq_len=128, profile=DEFAULT_PROFILE,
                                 vocab_parallel=vocab_parallel)
            got[vocab_parallel] = {r.world_size: r.tokens_per_s for r in est.rows}
        for t, measured in rows.items():
            cells = [f"{got[v][t]:.1f} ({got[v][t] / measured - 1:+.1%})" for v in (False, True)]
            print(f"| {name} | {t} | {measured} | {cells[0]} | {cells[1]} |")
    if args.calibrate:
        from tpkit.estimate.calibrate import calibrate_profile

        prof = calibrate_profile("gloo", (2,), quick=args.quick)
        hw, link = prof.hardware, prof.links["gloo"]
        print(f"\ncalibrated ({hw.name}): matmul fp32 {hw.peak_flops_fp32 / 1e9:.1f} GFLOP/s, bf16 "
              f"{hw.peak_flops_16bit / 1e9:.1f} GFLOP/s; copy {hw.memory_bandwidth / 1e9:.2f} GB/s; 2-rank gloo "
              f"all-reduce {2 * link.hop_latency_s * 1e6:.1f} us (8 B), {hw.interconnect.bandwidth / 1e9:.3f} GB/s "
              f"bus bandwidth")


if __name__ == "__main__":
    main()
