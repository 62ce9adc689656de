"""Pipeline parallelism on this machine: step time and measured bubble per schedule at pp2 against the formula, and
pp2 against tp2 and dp2 at one training shape drawn from a seed, with the setup search's pick against the measured
best. Every run is `tpkit.setups.run_setup` (fresh gloo processes, one thread each: a device is a core; median of
`--steps` steps after 2 warm-up steps, the slowest rank's; AdamW included), float32. The setups of a part alternate:
`--rounds` rounds each run every setup once (in reverse order every other round), and a setup's figure is the median
of its rounds, so a neighbour's load on a shared box falls on all of them alike.

Bubble: with T1 the step of the whole model on one rank (one thread), an ideal 2-stage pipeline takes T1 / 2; the
measured bubble is 1 - (T1 / 2) / T, against (p - 1) / (v m + p - 1). What it adds beyond the formula is the stages'
sends and each micro-batch's fixed costs (smaller matmuls, more Python).

    PYTHONPATH=src python bench/pipeline.py [--seed 0] [--steps 5] [--rounds 3] [--microbatches 2,4]
                                            [--profile FILE] [--part bubble|layouts|both]
"""
from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import subprocess

import torch

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2))


def config(hidden: int, layers: int, vocab: int = 4000):
    """A small float32 Llama (4 heads, 2 KV heads): a step at one thread takes a fraction of a second here."""
    import transformers as tr

    return tr.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 8 * 8,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=1024)


def _load() -> str:
    return open("/proc/loadavg").read().split()[0]


def measured(cfg, setups: list, batch: int, seq: int, args) -> dict:
    """Median seconds per step of each setup over `args.rounds` alternating rounds."""
    from tpkit.setups import run_setup

    runs: dict = {s: [] for s in setups}
    for r in range(args.rounds):
        for s in setups if r % 2 == 0 else setups[::-1]:
            runs[s].append(run_setup(cfg, s, "train", batch, seq, args.steps, threads=1, dtype=torch.float32))
    return {s: statistics.median(t) for s, t in runs.items()}


def bubbles(args) -> None:
    from tpkit.estimate.pipeline import bubble_fraction
    from tpkit.estimate.predict import Setup

    cfg, batch, seq = config(256, 4), 8, 64
    staged = [Setup(1, pp=2, microbatches=m, stages_per_rank=v, schedule=name)
              for name, v in SCHEDULES for m in args.microbatches]
    before = _load()
    times = measured(cfg, [Setup(1), *staged], batch, seq, args)
    one = times[Setup(1)]
    print(f"\nbubble at pp2: Llama hidden 256, 4 layers, vocab 4000, batch {batch} x seq {seq}; one rank: "
          f"{one * 1e3:.1f} ms per step; median of {args.rounds} alternating rounds (load {before} -> {_load()})\n")
    print("| schedule | stages per rank | micro-batches | step ms | measured bubble | formula | step / (T1 / 2) |")
    print("|---|---|---|---|---|---|---|")
    for s in staged:
        t = times[s]
        print(f"| {s.schedule} | {s.stages_per_rank} | {s.microbatches} | {t * 1e3:.1f} | {1 - one / 2 / t:.3f} "
              f"| {bubble_fraction(2, s.microbatches, s.stages_per_rank):.3f} | {t / (one / 2):.2f} |")


def layouts(args) -> None:
    from tpkit.estimate.predict import Setup
    from tpkit.setups import search

    rng = random.Random(args.seed)
    hidden, layers = rng.choice((192, 256, 320)), rng.choice((4, 6))
    batch, seq = rng.choice((4, 8)), rng.choice((32, 64))
    cfg = config(hidden, layers)
    print(f"\npp2 / tp2 / dp2, seed {args.seed}: Llama hidden {hidden}, {layers} layers, vocab 4000, batch {batch} "
          f"x seq {seq} (load {_load()})\n")
    result = search(cfg, 2, "train", batch_size=batch, seq_len=seq, profile=args.profile, dtype=torch.float32)
    pick = result.best.setup
    setups = [Setup(2), Setup(1, 2, "ddp"), Setup(1, 2, "fsdp"), Setup(1, pp=2, microbatches=2),
              Setup(1, pp=2, microbatches=batch)]
    setups += [pick] if pick not in setups else []
    predicted = {c.setup: c.prediction.seconds for c in result.candidates}
    before = _load()
    times = measured(cfg, setups, batch, seq, args)
    print(f"median of {args.rounds} alternating rounds (load {before} -> {_load()}); the search's best "
          f"{pick.label()}" + (f", tied within 5% with {'; '.join(c.setup.label() for c in result.tied)}"
                               if result.tied else "") + "\n")
    print("| setup | measured ms | predicted ms | predicted / measured |")
    print("|---|---|---|---|")
    for s in setups:
        guess = predicted.get(s)
        print(f"| {s.label()} | {times[s] * 1e3:.1f} | " + (f"{guess * 1e3:.1f} | {guess / times[s]:.2f} |" if guess
                                                              else "- | - |"))
    best = min(times, key=times.get)
    print(f"\nsearch picks {pick.label()} ({times[pick] * 1e3:.1f} ms measured); measured best {best.label()} "
          f"({times[best] * 1e3:.1f} ms): pick / best = {times[pick] / times[best]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; each setup's median is shown")
    parser.add_argument("--microbatches", default="2,4")
    parser.add_argument("--profile", default=None, help="speed profile for the search (default: the cached one)")
    parser.add_argument("--part", choices=("bubble", "layouts", "both"), default="both")
    args = parser.parse_args()
    args.microbatches = [int(m) for m in args.microbatches.split(",")]
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    print(f"bench/pipeline.py at {rev}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch "
          f"{torch.__version__}, {os.cpu_count()} cores, load {_load()} (1-min average; other jobs share the box)")
    if args.part in ("bubble", "both"):
        bubbles(args)
    if args.part in ("layouts", "both"):
        layouts(args)


if __name__ == "__main__":
    main()
