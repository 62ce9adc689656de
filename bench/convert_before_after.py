"""Conversion time of this tree against an earlier commit, measured in one run (issue: ShardLayout refactor).

Each round runs `analyze + plan + parallelize` of the Llama-2-7B-shaped meta model (bench/convert.py's
`meta_conversion`) in a fresh process for each tree, alternating which goes first; the figure is the median
over rounds of each process's median. The earlier commit is checked out with `git worktree` into a temporary
folder and removed afterwards.

Run: `python bench/convert_before_after.py --rev <commit> [--rounds 6 --repeats 3]`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = ("import json, sys; sys.path.insert(0, sys.argv[1] + '/bench'); import convert; "
         "print(json.dumps(convert.meta_conversion(int(sys.argv[2]))))")


def run(tree: Path, repeats: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(repeats)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rev", required=True, help="the earlier commit to compare with")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), args.rev], check=True)
        try:
            times: dict[str, list[float]] = {"before": [], "after": []}
            for i in range(args.rounds):
                order = [("before", old), ("after", ROOT)]
                for label, tree in (order if i % 2 == 0 else order[::-1]):
                    times[label].append(run(tree, args.repeats)["total"])
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    before, after = statistics.median(times["before"]), statistics.median(times["after"])
    print(f"| analyze + plan + parallelize, Llama-2-7B shape on meta, 2 thread-ranks | before ({args.rev[:8]}) "
          f"{before:.2f} s | after {after:.2f} s | ratio {after / before:.3f} |")
    print(json.dumps(times))


if __name__ == "__main__":
    main()
