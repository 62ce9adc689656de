"""TP2 (`--world N`: N ranks) eager greedy decode, ms/token, of this tree against an earlier commit, measured in one run
(issue 56 item 1: the per-token fixed cost).

The checkpoints are `bench/quantized.py`'s, made by this tree for the shape drawn from `--seed`. Each round launches
the gloo ranks once per tree (the order alternating between rounds); a launch loads every format asked for, decodes 3
tokens untimed after a prompt of `--prompt` tokens, then times `--tokens` (17) tokens less 1 token, over 16 (tokens
- 1), five times per format, taking turns, and keeps the median. The figure per tree is the median over rounds. The
earlier commit is checked out with `git worktree` into a temporary folder and removed afterwards.

    python bench/decode_before_after.py --rev <commit> [--rounds 4] [--seed 8725] [--formats int4 bf16] [--world 2]
        [--prompt 8] [--tokens 17]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from before_after import ROOT, checked_out, print_table


def _rank(paths: dict[str, str], prompt: int = 8, tokens: int = 17) -> dict[str, float]:
    """On one rank: each format's median ms/token (see the module doc)."""
    import torch

    import tpkit

    torch.set_num_threads(1)
    models = {f: tpkit.from_pretrained(p, progress=False) for f, p in paths.items()}
    ids = torch.randint(3, 1000, (1, prompt), generator=torch.Generator().manual_seed(1))

    def seconds(model, tokens: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start
    for model in models.values():
        seconds(model, 3)
    times: dict[str, list[float]] = {}
    for _ in range(5):
        for f, model in models.items():
            times.setdefault(f, []).append((seconds(model, tokens) - seconds(model, 1)) / (tokens - 1) * 1e3)
    return {f: statistics.median(t) for f, t in times.items()}


def child(paths: dict[str, str], world: int, prompt: int, tokens: int) -> None:
    """A launch of this tree's (or the PYTHONPATH's) tpkit on `world` ranks: rank 0's figures as one JSON line."""
    import tpkit

    print(json.dumps(tpkit.launch(_rank, world, args=(paths, prompt, tokens), timeout=3600)[0]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rev", required=True, help="the earlier commit to compare with")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=8725)
    parser.add_argument("--formats", nargs="+", default=["int4", "bf16"])
    parser.add_argument("--world", type=int, default=2, help="tensor-parallel ranks (gloo processes)")
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens (the cache a decode step attends over)")
    parser.add_argument("--tokens", type=int, default=17,
                        help="tokens timed, less 1 (after a long prompt take more: the prefill's noise cancels less)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child), args.world, args.prompt, args.tokens)
    sys.path[:0] = [str(ROOT), str(ROOT / "src")]
    from bench.quantized import draw, make

    with tempfile.TemporaryDirectory() as tmp:
        shape = draw(args.seed, False)
        made = make(os.path.join(tmp, "ck"), shape)
        paths = {f: made[f] for f in args.formats}
        print(f"seed {args.seed}, world {args.world}, prompt {args.prompt}: {shape}", flush=True)
        with checked_out(args.rev, Path(tmp) / "before") as trees:
            runs: dict[tuple[str, str], list[float]] = {}
            for r in range(args.rounds):
                for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                    env = dict(os.environ, PYTHONPATH=str(trees[name] / "src"))
                    out = subprocess.run([sys.executable, __file__, "--rev", args.rev, "--world", str(args.world),
                                          "--prompt", str(args.prompt), "--tokens", str(args.tokens),
                                          "--child", json.dumps(paths)],
                                         env=env, check=True, capture_output=True, text=True).stdout
                    figures = json.loads(out.strip().splitlines()[-1])
                    print(f"round {r + 1}, {name}: " + ", ".join(f"{f} {v:.2f}" for f, v in figures.items()),
                          flush=True)
                    for f, v in figures.items():
                        runs.setdefault((f, name), []).append(v)
            print_table("format", "ms/token", args.formats, runs, 2)


if __name__ == "__main__":
    main()
