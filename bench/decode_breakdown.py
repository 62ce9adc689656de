"""Where a decoded token's time goes, per format, against the memory limit: the products one decode step calls,
replayed alone, and the rest of the token.

The same random Llama as `bench/quantized.py` (`--seed`, or `--issue-shape`: hidden 2048, MLP 5632, 8 layers), in its
five formats, loaded by `tpkit.from_pretrained` in `--world` gloo processes (`--threads` torch threads each). In each
rank, forward hooks record the linear layers one decode step calls, in order, with their inputs (the last forward of a
2-token `generate`). Then, alternating formats over `--repeats` rounds, each turn measures:
- the streaming rate (`bench.quantized.streaming`: a float32 sum, every rank at once) and from it the memory limit,
  the bytes a rank reads per token over that rate;
- the products: the recorded calls replayed in order (every rank at once, so a row-parallel layer's all-reduce is in
  its call, as in the step), ms per step;
- the token: greedy `generate`, (N tokens - 1 token) / (N - 1).

"the rest" is the token less the products: attention, norms, the residual adds, `generate`'s own work. The layer table
splits the products by layer: each call timed alone (median), its bytes, and what it takes beyond streaming its bytes
at the turn's rate, summed over the step's calls of that layer ("beyond the stream").

    python bench/decode_breakdown.py [--issue-shape | --seed N] [--world 2] [--threads 1] [--formats int4,fp8]
                                     [--repeats 5] [--tokens 9]
"""
from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.quantized import FORMATS, bytes_per_token, draw, make, ms_per_token, streaming  # noqa: E402


def step_calls(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, torch.Tensor]]:
    """The linear layers (modules without children whose class name holds "Linear") one decode step of `model`
    calls, in order: (the layer's name in its block, e.g. "q_proj"; the layer; a copy of its input), recorded by
    forward hooks during the last forward of a 2-token greedy `generate` (the first decode step)."""
    names = {m: n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if "Linear" in type(m).__name__ and not list(m.children())}
    calls: list = []
    hooks = [m.register_forward_hook(lambda m, args, out: calls.append((names[m], m, args[0].clone())))
             for m in names]
    hooks.append(model.register_forward_pre_hook(lambda m, args: calls.clear()))  # each forward: its own calls
    try:
        ids = torch.randint(3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
    finally:
        for h in hooks:
            h.remove()
    return list(calls)


def _replay(calls) -> None:
    with torch.inference_mode():
        for _name, layer, x in calls:
            layer(x)


def _stored_bytes(layer: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])


def _rank(paths: dict[str, str], tokens: int, repeats: int, threads: int) -> dict:
    """One rank's figures, per format (see the module docstring)."""
    import tpkit

    torch.set_num_threads(threads)
    comm = tpkit.get_communicator()
    models = {f: tpkit.from_pretrained(p, progress=False) for f, p in paths.items()}
    steps = {f: step_calls(m) for f, m in models.items()}
    out: dict = {f: {"bytes": bytes_per_token(models[f]), "stream": [], "products": [], "token": [],
                     "layers": collections.defaultdict(list)} for f in models}
    for f, m in models.items():  # warm-up
        ms_per_token(m, 3)
        _replay(steps[f])
    for _ in range(repeats):
        for f, m in models.items():  # alternating
            mine = out[f]
            mine["stream"].append(streaming(0.2))
            comm.barrier()
            start = time.perf_counter()
            for _ in range(3):
                _replay(steps[f])
            mine["products"].append((time.perf_counter() - start) / 3 * 1e3)
            comm.barrier()
            with torch.inference_mode():
                for name, layer, x in steps[f]:  # each call alone
                    start = time.perf_counter()
                    layer(x)
                    mine["layers"][name].append(time.perf_counter() - start)
            mine["token"].append(ms_per_token(m, tokens))
    for f, mine in out.items():
        counts = collections.Counter(name for name, _l, _x in steps[f])
        sizes = {name: _stored_bytes(layer) for name, layer, _x in steps[f]}
        mine["layers"] = {name: (counts[name], sizes[name], statistics.median(v)) for name, v in mine["layers"].items()}
    return out


def report(ranks: list[dict], formats: list[str]) -> str:
    """The per-format table (medians over rounds, the slowest rank's) and each format's layer table (rank 0's)."""
    rows, layer_tables = [], []
    for f in formats:
        per_rank = [r[f] for r in ranks]
        stream = min(statistics.median(r["stream"]) for r in per_rank)
        limit = max(r["bytes"] for r in per_rank) / stream * 1e3
        products = max(statistics.median(r["products"]) for r in per_rank)
        token = max(statistics.median(r["token"]) for r in per_rank)
        rows.append(f"| {f} | {stream / 1e9:.1f} | {limit:.2f} | {products:.2f} ({products / limit:.2f}x) | "
                    f"{token - products:.2f} | {token:.2f} ({token / limit:.2f}x) |")
        lines = []
        for name, (count, size, seconds) in per_rank[0]["layers"].items():
            at_stream = size / stream
            lines.append(f"| {name} | {count} | {size / 2 ** 20:.2f} | {seconds * 1e6:.1f} | "
                         f"{size / seconds / 1e9:.1f} | {count * (seconds - at_stream) * 1e3:.2f} |")
        layer_tables.append("\n".join([f"{f}, rank 0, each call alone (streaming {stream / 1e9:.1f} GB/s):", "",
                                       "| layer | calls per step | MiB per call | us per call | GB/s | "
                                       "ms per token beyond the stream |", "|---|---|---|---|---|---|"] + lines))
    head = ["| format | streaming GB/s per rank | memory limit ms | products of one step, ms (/ limit) | "
            "the rest, ms | token ms (/ limit) |", "|---|---|---|---|---|---|"]
    return "\n".join(head + rows) + "\n\n" + "\n\n".join(layer_tables)


def main() -> None:
    import tpkit

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="the shape's seed (default: drawn now, printed)")
    ap.add_argument("--issue-shape", action="store_true", help="hidden 2048, MLP 5632, 8 layers")
    ap.add_argument("--world", type=int, default=2, help="tensor-parallel ranks (gloo processes), default 2")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank, default 1")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=9)
    args = ap.parse_args()
    formats = args.formats.split(",")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        ap.error(f"--formats: unknown {unknown}; choose from {', '.join(FORMATS)}")
    seed = args.seed if args.seed is not None else int(time.time()) % 10000
    shape = draw(seed, args.issue_shape)
    print(f"seed {seed}: {shape}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {f: p for f, p in make(tmp, shape).items() if f in formats}
        ranks = tpkit.launch(_rank, args.world, timeout=3600, args=(paths, args.tokens, args.repeats, args.threads))
    print(report(ranks, formats))
    print(f"\nTP{args.world}, {args.threads} thread{'s' if args.threads > 1 else ''} per rank; median of "
          f"{args.repeats} alternating rounds; load average {os.getloadavg()[0]:.2f}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores.")


if __name__ == "__main__":
    main()
