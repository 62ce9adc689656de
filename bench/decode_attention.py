"""Greedy decode after a long prompt with tpkit's float32 decode attention (`tpkit.nn.decode_attention`) against
torch's half-precision kernel, in one launch per world size, alternating on the same loaded model.

The checkpoints are `bench/quantized.py`'s for the Llama shape drawn from `--seed` (bf16 and int4 by default;
`--formats`). Each rank loads them with `tpkit.from_pretrained`, then per round and format times `generate` of
`--tokens` new tokens less 1 (ms/token: the prefill of the `--prompt` tokens cancels out) with the path on and off,
the order alternating between rounds. Off is a copy bound of 0 bytes (`decode_attention.MAX_COPY_BYTES`), which
sends every call to transformers' own "sdpa" function. Prints rank 0's medians as a table.

    python bench/decode_attention.py [--seed 4610] [--world 1 2] [--prompt 500] [--tokens 49] [--rounds 6]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(paths: dict[str, str], prompt: int, tokens: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    import tpkit
    from tpkit.nn import decode_attention

    torch.set_num_threads(1)
    bound = decode_attention.MAX_COPY_BYTES
    ids = torch.randint(3, 1000, (1, prompt), generator=torch.Generator().manual_seed(1))
    out = {}
    for fmt, path in paths.items():
        model = tpkit.from_pretrained(path, progress=False)

        def seconds(n: int, model=model) -> float:
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            return time.perf_counter() - start

        seconds(3)
        out[fmt] = {"float32 step": [], "torch's kernel": []}
        for r in range(rounds):
            for way in (list(out[fmt]) if r % 2 == 0 else list(reversed(out[fmt]))):
                decode_attention.MAX_COPY_BYTES = bound if way == "float32 step" else 0
                out[fmt][way].append((seconds(tokens) - seconds(1)) / (tokens - 1) * 1e3)
        decode_attention.MAX_COPY_BYTES = bound
    return out


def main() -> None:
    import tpkit
    from bench.quantized import draw, heads_of, make

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=4610)
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompt", type=int, default=500)
    ap.add_argument("--tokens", type=int, default=49)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--formats", nargs="+", default=["bf16", "int4"])
    args = ap.parse_args()
    shape = draw(args.seed, False)
    with tempfile.TemporaryDirectory() as tmp:
        made = make(os.path.join(tmp, "ck"), shape)
        paths = {f: made[f] for f in args.formats}
        for path in paths.values():  # positions up to the prompt and the tokens (the default RoPE reads no maximum)
            config = Path(path) / "config.json"
            data = json.loads(config.read_text())
            data["max_position_embeddings"] = max(data.get("max_position_embeddings", 0), args.prompt + args.tokens)
            config.write_text(json.dumps(data))
        print(f"seed {args.seed}: {shape}, heads / KV heads {heads_of(shape)}; prompt {args.prompt}, "
              f"{args.tokens} tokens, {args.rounds} alternating rounds", flush=True)
        print("\n| format | ranks | float32 step (ms/token) | torch's kernel (ms/token) | ratio | rounds faster |")
        print("|---|---:|---:|---:|---:|---:|")
        for world in args.world:
            figures = tpkit.launch(_rank, world, args=(paths, args.prompt, args.tokens, args.rounds),
                                   timeout=3600)[0]
            for fmt, runs in figures.items():
                ours, theirs = (statistics.median(runs[k]) for k in ("float32 step", "torch's kernel"))
                faster = sum(a < b for a, b in zip(runs["float32 step"], runs["torch's kernel"]))
                print(f"| {fmt} | {world} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.3f} | {faster} of "
                      f"{args.rounds} |", flush=True)


if __name__ == "__main__":
    main()
