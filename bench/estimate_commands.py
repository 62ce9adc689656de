"""Wall time of the estimate's commands in this tree against an earlier commit, measured in one run (issue 56 item 5:
the suite's calibration and estimate tests are these commands).

Each round runs, for each tree in a fresh process (the order alternating between rounds), `tpkit analyze` of a Llama
config drawn from `--seed` (training, world sizes up to 8: a setup search at each size), then `tpkit search` and
`tpkit estimate` of the same config in one process (what a program that asks all three pays); with `--calibrate`, a
quick calibration (`tpkit estimate --calibrate --quick`, minutes each). Every command prices the profile the first
calibration wrote, or, without `--calibrate`, a synthetic one (the tests' rates: nothing here is timed by it). With
`--models`, also the search at 3 devices of each model tests/test_training_paths.py trains (15 architectures, two
layers each: traced as they are, so nothing is kept between setups). The
earlier commit is checked out with `git worktree` into a temporary folder and removed afterwards.

    python bench/estimate_commands.py --rev <commit> [--rounds 3] [--seed 11] [--calibrate] [--models]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from before_after import ROOT, checked_out, print_table

THREE = ("import sys; from tpkit.cli import main; c = sys.argv[1]; "
         "main(['estimate', c, '--mode', 'training', '--batch-size', '2', '--seq-len', '32', '--json']); "
         "main(['search', c, '--devices', '2', '--goal', 'train', '--batch-size', '2', '--seq-len', '32', '--json']); "
         "main(['analyze', c, '--mode', 'training', '--max-world-size', '8', '--json'])")
MODELS = "from tests.models import paths as P; [P.tp_setup(P.ARCHS[name](), 3) for name in sorted(P.ARCHS)]"


def drawn_config(seed: int) -> dict:
    """A Llama shape drawn from `seed` (not one the estimate was tuned on)."""
    rng = random.Random(seed)
    heads = rng.choice([4, 8])
    hidden = heads * rng.choice([32, 48, 64, 96])
    return {"model_type": "llama", "vocab_size": rng.choice([8000, 16000, 32000]), "hidden_size": hidden,
            "intermediate_size": hidden * rng.choice([2, 3, 4]), "num_hidden_layers": rng.randint(3, 6),
            "num_attention_heads": heads, "num_key_value_heads": rng.choice([heads, heads // 2]),
            "max_position_embeddings": 128, "tie_word_embeddings": False}


def timed(tree: Path, args: list[str], profile: str) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "src"), str(tree)]), TPKIT_PROFILE=profile)
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def synthetic(path: str) -> str:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import synthetic_profile
    from tpkit.estimate.profile import save_profile

    return save_profile(synthetic_profile(), path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rev", required=True, help="the earlier commit to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--calibrate", action="store_true", help="time a quick calibration too (minutes each)")
    parser.add_argument("--models", action="store_true", help="time the training-paths models' searches too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with checked_out(args.rev, Path(tmp) / "before") as trees:
            config = Path(tmp) / "config.json"
            config.write_text(json.dumps(drawn_config(args.seed)))
            print(f"config (seed {args.seed}): {config.read_text()}")
            profile = synthetic(str(Path(tmp) / "synthetic.json"))
            commands = {"analyze": ["-m", "tpkit.cli", "analyze", str(config), "--mode", "training",
                                    "--max-world-size", "8", "--json"],
                        "estimate + search + analyze": ["-c", THREE, str(config)]}
            if args.models:
                commands["search of the training-paths models"] = ["-c", MODELS]
            if args.calibrate:
                commands["estimate --calibrate --quick"] = ["-m", "tpkit.cli", "estimate", "--calibrate", "--quick",
                                                            "--profile", str(Path(tmp) / "calibrated.json")]
            times: dict[tuple[str, str], list[float]] = {}
            for r in range(args.rounds):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))
                for name, command in commands.items():
                    for tree in order:
                        t = timed(trees[tree], command, profile)
                        times.setdefault((name, tree), []).append(t)
                        print(f"round {r + 1}: {name}, {tree}: {t:.1f} s", flush=True)
            print_table("command", "s", commands, times)


if __name__ == "__main__":
    main()
