"""Soak test of training that survives: tp2 x dp2 on 4 gloo processes under `torchrun --max-restarts`, faults at
random steps and phases, against the same run uninterrupted.

    PYTHONPATH=src python bench/soak.py [--faults 4] [--steps 16] [--every 2] [--seed 0] [--json out.json]

`examples/train_2d.py` runs twice with the same arguments: once clean, once with `TPKIT_FAULTS` naming one fault
per generation, each at a random step and phase: a rank killed before a step (`step`), inside the forward while
its peers wait in a collective (`forward`), killed at a save before its file (`save-start`), after it
(`save-files`), after the manifest before `latest` moves (`save-latest`), or a full disk while writing (`write`,
ENOSPC). Checked: every fault fired and every restart resumed from the last complete version before it (no
version lost beyond it); the final parameters (consolidated) and every step's loss equal the clean run's bit for
bit; the checkpoint directory holds `latest` and the newest `--keep` complete versions, nothing partial. Prints the
faults, the checks and the wall times.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.torchrun import ROOT, torchrun  # noqa: E402 - after the path

EXAMPLE = os.path.join(ROOT, "examples", "train_2d.py")
LOOP = ("step", "forward")
SAVE = ("save-start", "save-files", "save-latest", "write")


def pick_faults(n: int, steps: int, every: int, world: int, tp: int, rng: random.Random) -> list[dict]:
    """`n` faults, one per generation, fault i within the i-th of n equal windows of the run (so each generation
    gets to its fault). `step`: steps completed when it strikes; `resume`: where the next generation must start."""
    out, width = [], steps // n
    for generation in range(n):
        window = range(max(1, generation * width + 1), (generation + 1) * width + 1)
        loop = [k for k in window if k < steps]
        saves = [k for k in window if k % every == 0 and k <= steps]
        phase = rng.choice([p for p in LOOP + SAVE if (p in LOOP and loop) or (p in SAVE and saves)])
        step = rng.choice(loop if phase in LOOP else saves)
        resume = step // every * every if phase in LOOP else step if phase == "save-latest" else step - every
        # save-latest is rank 0's moment; a write fails where bytes are written (dp replicas write nothing)
        rank = 0 if phase == "save-latest" else rng.randrange(tp if phase == "write" else world)
        out.append({"point": phase, "step": step, "rank": rank,
                    "generation": generation, "resume": resume, "do": "enospc" if phase == "write" else "kill"})
    return out


def spec(faults: list[dict]) -> str:
    return "; ".join(f"{f['point']}:rank={f['rank']}:step={f['step']}:generation={f['generation']}:do={f['do']}"
                     for f in faults)


def losses(path: str) -> dict[int, float]:
    out = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row["step"] in out and out[row["step"]] != row["loss"]:
                raise AssertionError(f"step {row['step']} re-run gave loss {row['loss']!r}, first {out[row['step']]!r}")
            out[row["step"]] = row["loss"]
    return out


def final(directory: str) -> dict:
    from safetensors.torch import load_file

    import tpkit

    out = tempfile.mkdtemp()
    try:
        tpkit.consolidate(directory, os.path.join(out, "hf"))
        return load_file(os.path.join(out, "hf", "model.safetensors"))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--mode", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--seed", type=int, default=0, help="picks the faults")
    parser.add_argument("--timeout", type=float, default=30.0, help="collective timeout of the workers")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    faults = pick_faults(args.faults, args.steps, args.every, 4, 2, random.Random(args.seed))
    root = tempfile.mkdtemp(prefix="tpkit-soak-")
    common = ["--tp", "2", "--mode", args.mode, "--steps", str(args.steps), "--every", str(args.every), "--keep",
              str(args.keep), "--resume", "--global-batch", "8", "--seq", "32", "--vocab", "256", "--dropout", "0.1",
              "--timeout", str(args.timeout)]
    print(f"faults (TPKIT_FAULTS): {spec(faults)}")
    results, outputs = {}, {}
    for name, env in (("clean", None), ("faulty", {"TPKIT_FAULTS": spec(faults)})):
        code, output, seconds = torchrun(EXAMPLE, *common, "--save", os.path.join(root, name), "--history",
                                         os.path.join(root, f"{name}.jsonl"), nproc=4,
                                         max_restarts=args.faults if env else 0, env=env, timeout=1800)
        outputs[name] = output
        if code != 0:
            print(output[-6000:])
            raise SystemExit(f"{name} run failed with exit code {code}")
        results[name] = seconds
        print(f"{name}: {seconds:.1f} s")
    starts = [int(m) for m in re.findall(r"generation \d+, starting at step (\d+)", outputs["faulty"])]
    fired = re.findall(r"tpkit fault: killing rank \d+ at [\w-]+ \(step \d+", outputs["faulty"]) + \
        re.findall(r"could not write it \(No space left on device\)", outputs["faulty"])
    checks = {
        "every fault fired": len(set(fired)) == len(faults),
        "each restart resumed from the last complete version": starts == [0] + [f["resume"] for f in faults],
        "losses equal, every step (bit for bit)": losses(os.path.join(root, "faulty.jsonl")) ==
        losses(os.path.join(root, "clean.jsonl")),
    }
    clean, got = final(os.path.join(root, "clean")), final(os.path.join(root, "faulty"))
    checks["final parameters equal (bit for bit)"] = clean.keys() == got.keys() and all(
        torch.equal(clean[k], got[k]) for k in clean)
    listing = sorted(os.listdir(os.path.join(root, "faulty")))
    steps = [name.split("-step-")[-1] for name in listing if name.startswith("v")]
    wanted = [f"{s:09d}" for s in range(args.steps - (args.keep - 1) * args.every, args.steps + 1, args.every)]
    checks["directory: latest + the newest --keep complete versions, nothing partial"] = \
        listing[0] == "latest" and steps == wanted and all(
            os.path.exists(os.path.join(root, "faulty", n, "manifest.json")) for n in listing if n.startswith("v"))
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    redone = sum(f["step"] - f["resume"] for f in faults)
    print(f"generations started at steps {starts}; steps run again: {redone}; "
          f"wall: clean {results['clean']:.1f} s, faulty {results['faulty']:.1f} s "
          f"({results['faulty'] / results['clean']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"faults": faults, "checks": checks, "starts": starts, "seconds": results}, f, indent=1)
    shutil.rmtree(root, ignore_errors=True)
    if not all(checks.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
