"""Are the plan variants priced as they run? For a model at TP 2 (2 gloo processes, one thread each), every plan the
search offers (the families' defaults, and each family's alternative over them: attention whole, MLP whole, the LM
head replicated, ...) is predicted from a profile and run for real, alternating, median of `--rounds` rounds of
`--steps` steps each (`tpkit.setups.run_setup`). Also run: `tpkit.parallelize`'s default plan ("auto") and the plan
`search` hands to `apply_setup` (`result.best.plan`), so that the two can be compared with each other.

The cases: the two issue 49 item 8 reported (the search's plan 15-16% slower than the default plan; their layer count
and vocabulary were not given: 4 and 8000 here), and `--random N`
shapes drawn from `--seed` (drawn at run time when not given; shapes as `bench/estimate_accuracy.py --random`).

    PYTHONPATH=src python bench/plan_variants.py --profile FILE [--random 2] [--seed S] [--rounds 3] [--steps 3]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from estimate_accuracy import _profile, random_shapes, shape_config  # noqa: E402

SEQ = 64
ISSUE_CASES = [{"family": "qwen2", "hidden": 1024, "heads": 16, "layers": 4, "batch": 4, "goal": "train",
                "vocab": 8000},
               {"family": "gpt2", "hidden": 384, "heads": 6, "layers": 4, "batch": 16, "goal": "decode", "vocab": 8000}]


def variants(result) -> list:
    """The search's TP-2 candidates without data parallel, sequence parallel, recompute or stages: one per plan."""
    return [c for c in result.candidates if c.tp == 2 and c.dp == 1 and not c.sequence_parallel
            and c.recompute == "none" and getattr(c, "pp", 1) == 1]


def measure_case(shape: dict, prof, rounds: int, steps: int) -> list[tuple[str, float | None, float]]:
    """(plan, predicted s, measured s) of every TP-2 plan variant of `shape`, of the search's pick with the plan
    it hands to `apply_setup`, and of `parallelize`'s default plan."""
    from tpkit.estimate.predict import Setup
    from tpkit.estimate.search import search
    from tpkit.setups import run_setup

    cfg = shape_config(shape)
    goal, batch = shape["goal"], shape["batch"]
    result = search(cfg, 2, goal, batch_size=batch, seq_len=SEQ, profile=prof)
    runs = [(c.setup.label(), c.setup, None, c.prediction.seconds) for c in variants(result)]
    best = result.best
    if best.setup.tp == 2:  # (a TP-1 pick has no plan to compare)
        runs.append((f"the search's pick ({best.setup.label()}), result.best.plan", best.setup, best.plan,
                     best.prediction.seconds))
    runs.append(("tp2, parallelize's default plan ('auto')", Setup(2, 1, None), "auto", None))
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):  # alternating: a slow spell of the box hits every variant alike
        for i, (_, setup, plan, _) in enumerate(runs):
            times[i].append(run_setup(cfg, setup, goal, batch, SEQ, steps, threads=1, plan=plan))
    return [(label, predicted, statistics.median(t)) for (label, _, _, predicted), t in zip(runs, times)]


def main() -> None:
    from tpkit.estimate.search import NOISE

    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default=None)
    parser.add_argument("--random", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-issue", action="store_true", help="only the drawn shapes")
    args = parser.parse_args()
    prof = _profile(args)
    cases = [] if args.no_issue else list(ISSUE_CASES)
    if args.random:
        seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2 ** 31)
        print(f"seed {seed} ({'given' if args.seed is not None else 'drawn at run time'})")
        cases += random_shapes(args.random, seed)
    for n, shape in enumerate(cases, 1):
        rows = measure_case(shape, prof, args.rounds, args.steps)
        unit = "ms/token" if shape["goal"] == "decode" else "ms/step"
        print(f"\ncase {n}: {shape['family']} hidden {shape['hidden']}, {shape['heads']} heads, {shape['layers']} "
              f"layers, vocab {shape['vocab']}; {shape['goal']} batch {shape['batch']} x {SEQ}, TP 2, {unit}\n")
        print("| plan | predicted | measured (median) | error |")
        print("|---|---|---|---|")
        for label, predicted, measured in rows:
            error = f"{(predicted / measured - 1) * 100:+.1f}%" if predicted else ""
            print(f"| {label} | {predicted * 1e3:.2f} | {measured * 1e3:.2f} | {error} |" if predicted else
                  f"| {label} | | {measured * 1e3:.2f} | |")
        priced = [r for r in rows if r[1] is not None and not r[0].startswith("the search")]
        by_prediction, by_measure = min(priced, key=lambda r: r[1]), min(priced, key=lambda r: r[2])
        off = by_prediction[2] / by_measure[2] - 1
        print(f"\npredicted fastest: {by_prediction[0]}; measured fastest: {by_measure[0]}; the predicted one ran "
              f"{off:+.1%} against the measured best ({'within' if off <= NOISE else 'outside'} the search's "
              f"{NOISE:.0%} tie band)")


if __name__ == "__main__":
    main()
