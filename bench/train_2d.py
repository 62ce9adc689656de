"""Training step time and memory per rank: tp2 x dp2 (FSDP2, DDP) vs tp4 vs dp4 (FSDP2, DDP), 4 gloo ranks.

Step time: one `tpkit.launch` of 4 processes builds every layout side by side (each from the same full Llama,
deep-copied), warms each up, then times one AdamW step (forward, backward, global clip, optimizer) of each
layout in turn, the order rotating every round, a barrier before and after each step; the figure is rank 0's
wall time between the barriers. Median over --rounds, and each layout's ratio to tp4 (pure TP) computed from
the steps timed in the same round (median of the per-round ratios).

Memory: one launch per layout (so RSS belongs to one layout): parameter + optimizer bytes this rank holds
(FSDP2 shards counted by their local part, after resharding) and the RSS growth from before the model was built
to after --mem-steps steps, the largest over the 4 ranks; both also as a fraction of one device's.

    PYTHONPATH=src python bench/train_2d.py [--rounds 10] [--hidden 256] [--layers 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch

import tpkit

LAYOUTS = ("tp2xdp2-fsdp", "tp2xdp2-ddp", "tp4", "dp4-fsdp", "dp4-ddp")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(args) -> torch.nn.Module:
    import transformers as tr

    config = tr.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                            num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                            vocab_size=args.vocab, max_position_embeddings=args.seq)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(config)


def setup(layout: str, model0: torch.nn.Module, world):
    """`(model, optimizer, dp communicator or None)` of one layout on this rank."""
    model = copy.deepcopy(model0)
    if layout == "tp4":
        return _with_opt(tpkit.parallelize(model, comm=world, mode="training"), None)
    tp_size = 2 if layout.startswith("tp2") else 1
    tp, dp = tpkit.comm.split(world, tp_size) if tp_size > 1 else (None, world)
    if tp is not None:
        model = tpkit.parallelize(model, comm=tp, mode="training")
    return _with_opt(tpkit.data_parallel(model, dp, mode=layout.rsplit("-", 1)[1]), dp)


def _with_opt(model, dp):
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), dp


def step(model, opt, dp, ids) -> None:
    mine = ids.chunk(dp.world_size)[dp.rank] if dp is not None else ids
    model(input_ids=mine, labels=mine).loss.backward()
    tpkit.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def time_body(args) -> dict:
    world = tpkit.get_communicator()
    model0 = build(args)
    runs = {name: setup(name, model0, world) for name in LAYOUTS}
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    for name in LAYOUTS:
        for _ in range(args.warmup):
            step(*runs[name], ids)
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for r in range(args.rounds):
        for name in LAYOUTS[r % len(LAYOUTS):] + LAYOUTS[:r % len(LAYOUTS)]:
            world.barrier()
            start = time.perf_counter()
            step(*runs[name], ids)
            world.barrier()
            times[name].append(time.perf_counter() - start)
    return times


def memory_body(args, layout: str) -> dict:
    from tpkit.data_parallel import local_bytes

    world = tpkit.get_communicator()
    model0 = build(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    before = rss()
    model, opt, dp = setup(layout, model0, world)
    del model0
    for _ in range(args.mem_steps):
        step(model, opt, dp, ids)
    return {"bytes": local_bytes(model, opt), "rss": rss() - before}


def single_device_bytes(args) -> int:
    model = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    opt.step()
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--mem-steps", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over dp)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    times = tpkit.launch(time_body, 4, backend="gloo", args=(args,), timeout=1200)[0]
    base = times["tp4"]
    out = {"args": vars(args), "layouts": {}}
    for name in LAYOUTS:
        ratios = [t / b for t, b in zip(times[name], base)]
        out["layouts"][name] = {"median_ms": statistics.median(times[name]) * 1e3,
                                "ratio_to_tp4": statistics.median(ratios)}
    if not args.skip_memory:
        single = single_device_bytes(args)
        out["single_device_bytes"] = single
        for name in LAYOUTS:
            per_rank = tpkit.launch(memory_body, 4, backend="gloo", args=(args, name), timeout=1200)
            worst_bytes, worst_rss = max(r["bytes"] for r in per_rank), max(r["rss"] for r in per_rank)
            out["layouts"][name].update(bytes=worst_bytes, bytes_fraction=worst_bytes / single, rss=worst_rss,
                                        rss_fraction=worst_rss / single)
    print(f"{'layout':14s} {'step ms':>9s} {'vs tp4':>7s} {'param+opt MiB':>14s} {'of 1 dev':>9s} {'RSS MiB':>8s}")
    for name, d in out["layouts"].items():
        mem = (f"{d['bytes'] / 2**20:14.2f} {d['bytes_fraction']:9.3f} {d['rss'] / 2**20:8.1f}" if "bytes" in d else "")
        print(f"{name:14s} {d['median_ms']:9.1f} {d['ratio_to_tp4']:7.3f} {mem}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
