"""Benchmark of plan cost against depth (issue 21 item 1): `tpkit.plan` of a hidden-1024 Llama on the meta device
at 2, 32 and 80 layers, with plan reuse (repeated blocks take the traced block's entries) and without (the whole
forward traced). Each run plans a fresh deep copy (no per-model cache); runs go round robin over the depths and modes;
medians of `--repeats` runs. The target:
80 layers within 1.5x of 2 layers with reuse.

Run: `python bench/plan_depth.py [--repeats 7] [--layers 2 32 80]`. Prints a markdown table for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch


def llama(layers: int):
    import transformers as tr

    config = tr.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
                            num_hidden_layers=layers, vocab_size=32000, max_position_embeddings=2048)
    with torch.device("meta"):
        return tr.LlamaForCausalLM(config)


def plan_once(model, reuse: bool) -> tuple[float, dict]:
    import tpkit

    fresh = copy.deepcopy(model)
    t = time.perf_counter()
    result = tpkit.plan(fresh, 2, reuse=reuse)
    return time.perf_counter() - t, result.to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 32, 80])
    args = parser.parse_args()
    models = {n: llama(n) for n in args.layers}
    times: dict = {}
    plans: dict = {}
    for _ in range(args.repeats):  # round robin: a burst of load on the shared box hits every figure alike
        for n, model in models.items():
            for reuse in (True, False):
                seconds, plans[n, reuse] = plan_once(model, reuse)
                times.setdefault((n, reuse), []).append(seconds)
    for n in models:
        assert plans[n, True] == plans[n, False], f"{n} layers: the reused plan differs from the whole trace's"
    rows = [(n, statistics.median(times[n, True]), statistics.median(times[n, False])) for n in models]
    base_on, base_off = rows[0][1], rows[0][2]
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.repeats} repeats, "
          f"medians; plans equal with and without reuse at every depth\n")
    print("| layers | reuse (s) | vs 2 layers | whole trace (s) | vs 2 layers | whole / reuse |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, on, off in rows:
        print(f"| {n} | {on:.3f} | {on / base_on:.2f}x | {off:.3f} | {off / base_off:.2f}x | {off / on:.1f}x |")


if __name__ == "__main__":
    main()
