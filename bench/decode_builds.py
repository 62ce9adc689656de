"""Greedy decode by two builds of tpkit's compiled product (`TPKIT_NATIVE_ISA` paths), in one launch per world size,
alternating on the same loaded model: what one product path buys a whole decode.

The checkpoints are `bench/quantized.py`'s for the Llama shape drawn from `--seed` (`--issue-shape`: hidden 2048, MLP
5632, 8 layers), int8 and int4 by default (`--formats`). Each rank loads them with `tpkit.from_pretrained` (its
layers choose their products with this machine's native build), builds the other path (`--against`, default
"avx512": int8 by the float32 loops; "avx512-bf16": int4 by the bf16 dot products), and per round and format times
`generate` of `--tokens` new tokens less 1 after an 8-token prompt with each build bound in turn (`native._LIB`),
the order alternating between rounds. Prints rank 0's medians.

    python bench/decode_builds.py [--seed 4610 | --issue-shape] [--world 1 2] [--against avx512] [--rounds 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(paths: dict[str, str], against: str, tokens: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    import tpkit
    from tpkit.quant import native

    torch.set_num_threads(1)
    models = {f: tpkit.from_pretrained(p, progress=False) for f, p in paths.items()}
    builds = {"native": native._function(), against: native.build(native.ISA_FLAGS[against])}
    ids = torch.randint(3, 1000, (1, 8), generator=torch.Generator().manual_seed(1))

    def seconds(model, n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    out = {f: {b: [] for b in builds} for f in models}
    for r in range(rounds):
        for name in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
            native._LIB[:] = [builds[name]]
            for fmt, model in models.items():
                seconds(model, 2)
                out[fmt][name].append((seconds(model, tokens) - seconds(model, 1)) / (tokens - 1) * 1e3)
    native._LIB[:] = [builds["native"]]
    return out


def main() -> None:
    import tpkit
    from bench.quantized import draw, make

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=4610)
    ap.add_argument("--issue-shape", action="store_true")
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--against", default="avx512", help="the other TPKIT_NATIVE_ISA path (native.ISA_FLAGS)")
    ap.add_argument("--tokens", type=int, default=17)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--formats", nargs="+", default=["int8", "int4"])
    args = ap.parse_args()
    shape = draw(args.seed, args.issue_shape)
    with tempfile.TemporaryDirectory() as tmp:
        made = make(os.path.join(tmp, "ck"), shape)
        paths = {f: made[f] for f in args.formats}
        print(f"{'issue shape' if args.issue_shape else f'seed {args.seed}'}: {shape}; native against "
              f"{args.against}, {args.tokens} tokens, {args.rounds} alternating rounds", flush=True)
        print(f"\n| format | ranks | native (ms/token) | {args.against} (ms/token) | ratio |\n|---|---:|---:|---:|---:|")
        for world in args.world:
            figures = tpkit.launch(_rank, world, args=(paths, args.against, args.tokens, args.rounds),
                                   timeout=3600)[0]
            for fmt, runs in figures.items():
                ours, theirs = (statistics.median(runs[k]) for k in ("native", args.against))
                print(f"| {fmt} | {world} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.3f} |", flush=True)


if __name__ == "__main__":
    main()
