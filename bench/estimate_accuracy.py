"""How close the speed estimates come to what runs: published GPU decode figures, and measured runs here.

Published figures: github.com/pytorch-labs/gpt-fast README ("Tensor Parallelism"), Llama-2-7B and Llama-2-70B,
bf16, batch 1, torch.compile, 8xA100-80GB NVLink (330 W). The default profile was fitted on the 7B rows only;
the 70B rows are held out. Both layouts are shown: gpt-fast's (embedding and output replicated,
`vocab_parallel=False`) and tpkit's (vocab-parallel).

`--measured`: the op-level predictions (`tpkit.estimate.predict`) against runs on this machine: decode ms/token
and training step time (forward, backward, AdamW) of converted Llama and GPT-2 models (hidden 256-2048, 2-8
layers, batch 1 and 8) at TP 1 (one process) and TP 2 (two gloo processes), one thread per rank (a device = a
core). The profile is measured first (`--profile FILE` to reuse one); every run is a fresh set of processes
(`tpkit.setups.run_setup`: warm-up, then the median of `--steps`, the slowest rank's); with `--repeats R` each
case runs R times at TP 1 and TP 2 alternating and the median run is kept (a set of processes on this box can
land on a slow spell: the same step measured 1.6 ms in one and 3-4 ms in another).

`--random N [--seed S]`: shapes nobody chose, so nothing can have been tuned to them (issue 38): N shapes drawn
from the seed (a seed is drawn at run time and printed when none is given): family Llama / Qwen2 / GPT-2, hidden
128-2048 in steps of 64, 2-8 layers, heads dividing the hidden size (head width 32-128), batch 1-32, decode or
training at seq 64 (training batch capped so a step stays under about 20 s on one core). Each is measured at TP 1
and TP 2 and predicted from the profile; `--search` also runs every search setup of the training shapes (TP 1, TP 2,
TP 2 + SP, DDP, FSDP) and reports whether the search's pick is within 10% of the measured best.

    PYTHONPATH=src python bench/estimate_accuracy.py [--calibrate] [--quick]
    PYTHONPATH=src python bench/estimate_accuracy.py --measured [--profile FILE] [--steps 5] [--repeats 3]
        [--only decode|train] [--issue]
    PYTHONPATH=src python bench/estimate_accuracy.py --random 12 [--seed S] [--profile FILE] [--search]
"""
from __future__ import annotations

import argparse

import torch

from tpkit.estimate.presets import preset_config
from tpkit.estimate.profile import DEFAULT_PROFILE
from tpkit.estimate.speed import estimate_speed

PUBLISHED = {"llama-2-7b": {1: 104.9, 2: 168.84, 4: 254.02, 8: 328.43},
             "llama-2-70b": {2: 21.32, 4: 38.01, 8: 62.50}}


# (architecture, hidden, layers, goal, batch, vocab): the grid of the issue, kept to what a 2-core box runs in minutes.
CASES = [("llama", 256, 2, "decode", 1, 8000), ("llama", 512, 4, "decode", 1, 32000), ("llama", 1024, 4, "decode", 8, 8000),
         ("llama", 2048, 8, "decode", 1, 8000), ("gpt2", 256, 2, "decode", 8, 8000), ("gpt2", 768, 4, "decode", 1, 8000),
         ("gpt2", 1024, 8, "decode", 1, 8000), ("llama", 256, 2, "train", 8, 8000), ("llama", 512, 4, "train", 1, 8000),
         ("llama", 1024, 2, "train", 8, 8000), ("gpt2", 256, 4, "train", 1, 8000), ("gpt2", 512, 2, "train", 8, 8000),
         ("gpt2", 1024, 4, "train", 1, 8000)]
SEQ = 64
# The cases issue 38 was opened with (family, hidden, heads, layers, goal, batch, vocab), measured there right after
# a calibration: 45% median and 78% worst too fast. `--measured --issue` runs them.
ISSUE_CASES = [("qwen2", 384, 6, 3, "decode", 1, 32000), ("gpt2", 1536, 24, 6, "decode", 1, 50257),
               ("qwen2", 384, 6, 3, "train", 4, 32000), ("gpt2", 768, 12, 3, "train", 4, 50257)]


def config(arch: str, hidden: int, layers: int, vocab: int):
    import transformers as tr

    if arch == "llama":
        heads = max(hidden // 128, 2)
        return tr.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                              max_position_embeddings=256, tie_word_embeddings=False)
    return tr.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=max(hidden // 64, 2), n_positions=256,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


FAMILY_NAMES = ("llama", "qwen2", "gpt2")


def random_shapes(n: int, seed: int) -> list[dict]:
    """`n` shapes drawn from `seed` (see the module doc); the same seed gives the same shapes."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        hidden = rng.randrange(128, 2049, 64)
        widths = [d for d in (32, 64, 128) if hidden % d == 0]
        heads = hidden // rng.choice(widths)
        goal = rng.choice(("decode", "train"))
        layers = rng.randint(2, 8)
        batch = rng.randint(1, 32)
        if goal == "train":  # about 6 * params * tokens FLOPs at ~50 GFLOP/s: keep a step under ~20 s
            params = 12 * layers * hidden * hidden
            batch = max(1, min(batch, int(20 * 50e9 / (6 * params * SEQ))))
        out.append({"family": rng.choice(FAMILY_NAMES), "hidden": hidden, "heads": heads, "layers": layers,
                    "batch": batch, "goal": goal, "vocab": rng.choice((4000, 8000, 16000))})
    return out


def shape_config(shape: dict):
    """The transformers config of a drawn shape (float32 on the CPU; heads divide hidden; MLP 4x or gated 2.75x)."""
    import transformers as tr

    h, heads, layers, vocab = shape["hidden"], shape["heads"], shape["layers"], shape["vocab"]
    if shape["family"] == "gpt2":
        return tr.GPT2Config(vocab_size=vocab, n_embd=h, n_layer=layers, n_head=heads, n_positions=256,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cls = tr.LlamaConfig if shape["family"] == "llama" else tr.Qwen2Config
    kv = heads if heads % 2 else heads // 2  # grouped-query where the heads allow
    return cls(vocab_size=vocab, hidden_size=h, intermediate_size=int(h * 2.75) // 64 * 64, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
               tie_word_embeddings=False)


def _profile(args):
    from tpkit.estimate.calibrate import calibrate_profile
    from tpkit.estimate.profile import load_profile, save_profile

    if args.profile and __import__("os").path.exists(args.profile):
        return load_profile(args.profile)
    from tpkit.setups import DP_WRAPPERS

    prof = calibrate_profile("gloo", (2,), threads=1, dp_wrappers=DP_WRAPPERS)
    if args.profile:
        save_profile(prof, args.profile)
    return prof


def run_random(args) -> None:
    """Measure and predict `args.random` drawn shapes at TP 1 and TP 2; median / worst |error| per goal."""
    import random
    import statistics

    from tpkit.estimate.predict import Setup, predict
    from tpkit.estimate.terms import profile_terms
    from tpkit.setups import run_setup

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2 ** 31)
    print(f"seed {seed} ({'given' if args.seed is not None else 'drawn at run time'}); {args.random} shapes")
    prof = _profile(args)
    print("calibration terms:")
    for line in profile_terms(prof):
        print(f"  {line}")
    print("| # | family | hidden | heads | layers | goal | batch | TP | measured ms | predicted ms | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {"decode": [], "train": []}
    picks = []
    for i, shape in enumerate(random_shapes(args.random, seed), 1):
        cfg = shape_config(shape)
        goal, batch = shape["goal"], shape["batch"]
        runs: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(args.repeats):  # TP 1 and TP 2 alternating, each time in fresh processes
            for tp in runs:
                runs[tp].append(run_setup(cfg, Setup(tp), goal, batch, SEQ, steps=args.steps, threads=1,
                                          dtype=torch.float32))
        for tp in (1, 2):
            got = statistics.median(runs[tp])
            pred = predict(cfg, Setup(tp), goal, batch, SEQ, prof, dtype=torch.float32).seconds
            errors[goal].append(abs(pred / got - 1))
            print(f"| {i} | {shape['family']} | {shape['hidden']} | {shape['heads']} | {shape['layers']} | {goal} | "
                  f"{batch} | {tp} | {got * 1e3:.2f} | {pred * 1e3:.2f} | {pred / got - 1:+.1%} |", flush=True)
        if args.search and goal == "train":
            picks.append(_search_pick(cfg, batch, prof, args))
    for goal, errs in errors.items():
        if errs:
            print(f"\n{goal}: median |error| {statistics.median(errs):.1%}, worst {max(errs):.1%} over {len(errs)} "
                  f"runs (seed {seed}; target median <= 20%, worst <= 35%)")
    if picks:
        within = sum(p <= 1.10 for p in picks)
        print(f"\nsearch: pick within 10% of the measured best on {within} of {len(picks)} training shapes "
              f"(pick / best: {', '.join(f'{p:.2f}' for p in picks)})")


SEARCH_SETUPS = (("tp1", dict(tp=1)), ("tp2", dict(tp=2)), ("tp2 sp", dict(tp=2, sequence_parallel=True)),
                 ("ddp", dict(tp=1, dp=2, dp_mode="ddp")), ("fsdp", dict(tp=1, dp=2, dp_mode="fsdp")))


def _search_pick(cfg, batch: int, prof, args) -> float:
    """Every search setup of a training shape measured (2 devices); the predicted best's measured time over the
    measured best's."""
    from tpkit.convert.errors import PlanError
    from tpkit.estimate.predict import Setup, predict
    from tpkit.setups import run_setup

    measured, predicted = {}, {}
    for label, kw in SEARCH_SETUPS:
        setup = Setup(**kw)
        one = setup.devices == 1
        try:  # a setup tpkit cannot build for this shape (sequence parallelism with a block kept whole) is not run
            predicted[label] = predict(cfg, setup, "train", batch, SEQ, prof, dtype=torch.float32,
                                       ranks=1 if one else None).seconds
        except PlanError as e:
            print(f"  search: {label} cannot be built for this shape ({str(e)[:120]}...)", flush=True)
            continue
        measured[label] = run_setup(cfg, setup, "train", batch, SEQ, steps=args.steps, threads=1,
                                    dtype=torch.float32)
    pick = min(predicted, key=predicted.get)
    best = min(measured, key=measured.get)
    print("  search: " + "; ".join(f"{k} measured {measured[k] * 1e3:.0f} / predicted {predicted[k] * 1e3:.0f} ms"
                                   for k in measured) + f"; picked {pick}, best {best}", flush=True)
    return measured[pick] / measured[best]


def run_measured(args) -> None:
    import statistics

    from tpkit.estimate.predict import Setup, predict
    from tpkit.setups import run_setup

    prof = _profile(args)
    print("| model | hidden | layers | goal | batch | TP | measured ms | predicted ms | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    errors = {"decode": [], "train": []}
    cases = [(f, h, None, L, g, b, v) for f, h, L, g, b, v in CASES] if not args.issue else ISSUE_CASES
    for arch, hidden, heads, layers, goal, batch, vocab in cases:
        if args.only and goal != args.only:
            continue
        cfg = config(arch, hidden, layers, vocab) if heads is None else shape_config(
            dict(family=arch, hidden=hidden, heads=heads, layers=layers, vocab=vocab))
        runs: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(args.repeats):  # TP 1 and TP 2 alternating, each time in fresh processes
            for tp in runs:
                runs[tp].append(run_setup(cfg, Setup(tp), goal, batch, SEQ, steps=args.steps, threads=1,
                                          dtype=torch.float32))
        for tp in (1, 2):
            setup = Setup(tp)
            got = statistics.median(runs[tp])
            pred = predict(cfg, setup, goal, batch, SEQ, prof, dtype=torch.float32).seconds
            err = pred / got - 1
            errors[goal].append(abs(err))
            print(f"| {arch} | {hidden} | {layers} | {goal} | {batch} | {tp} | {got * 1e3:.2f} | {pred * 1e3:.2f} | "
                  f"{err:+.1%} |", flush=True)
    for goal, errs in errors.items():
        if errs:
            print(f"\n{goal}: median |error| {statistics.median(errs):.1%}, worst {max(errs):.1%} over {len(errs)} runs")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calibrate", action="store_true", help="also measure this machine (gloo, 2 ranks)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--measured", action="store_true", help="op-level predictions against runs on this machine")
    parser.add_argument("--profile", default=None, help="with --measured: profile to read (or write, when absent)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1,
                        help="with --measured: fresh process sets per case and TP, alternating; the median is kept")
    parser.add_argument("--only", choices=["decode", "train"], default=None)
    parser.add_argument("--random", type=int, default=0, metavar="N", help="N shapes drawn from --seed (see above)")
    parser.add_argument("--seed", type=int, default=None, help="with --random (default: drawn now, printed)")
    parser.add_argument("--search", action="store_true", help="with --random: the search's pick on training shapes")
    parser.add_argument("--issue", action="store_true", help="with --measured: issue 38's four cases instead")
    args = parser.parse_args()
    if args.random:
        run_random(args)
        return
    if args.measured:
        run_measured(args)
        return
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
