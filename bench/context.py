"""Context parallelism on this box: activation memory, peak memory and step time per rank as the sequence grows,
at cp1 / cp2 / cp4, all-to-all against ring, and the longest sequence that trains in a fixed per-rank budget.

One `tpkit.launch` of cp gloo processes per cp size (cp1 is one process running the model as it is, no tpkit).
Sequence lengths are drawn from --seed in [--min-seq, --max-seq] (shapes not tuned on). Per (cp, method, length):
- activation bytes: what autograd holds for the backward after the forward (every tensor saved for it but the
  weights, counted once per storage, through `torch.autograd.graph.saved_tensors_hooks`), the largest rank's;
- peak RSS growth over one forward + backward (Linux: `clear_refs` 5 resets the high-water mark), largest rank;
- step time: forward + backward of the whole batch, rank 0's wall time between barriers, median of --rounds.
The longest trainable sequence: the budget is cp1's activation bytes at --budget-seq tokens; for each cp and
method the longest multiple of 64 tokens whose activation bytes fit it (doubling, then bisection; forwards only).

    PYTHONPATH=src python bench/context.py [--rounds 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time

import torch

import tpkit


def build(args) -> torch.nn.Module:
    import transformers as tr

    config = tr.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                            num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                            vocab_size=args.vocab, max_position_embeddings=1 << 20, attn_implementation="sdpa")
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(config)


def saved_bytes(run, model: torch.nn.Module) -> int:
    """Bytes autograd holds for the backward of what `run()` computes (each storage once), the model's own
    parameters left out: activations, not weights."""
    seen: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(seen.values())


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def peak_growth(run) -> int:
    """Peak RSS above the RSS before `run()` (forward and backward)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return -1
    before = _status("VmRSS:")
    run()
    return _status("VmHWM:") - before


def measure(comm, args, model0, cp: int, method: str, lengths: list[int]) -> dict:
    """On one rank: the figures of every length for this cp and method (comm None: cp1, the model as it is)."""
    model = copy.deepcopy(model0)
    if comm is not None:
        tpkit.context_parallel(model, comm, method=method)
    results = {}
    for length in lengths:
        ids = torch.randint(0, args.vocab, (args.batch, length), generator=torch.Generator().manual_seed(length))
        forward = lambda: model(input_ids=ids, labels=ids, use_cache=False if comm is None else None).loss  # noqa: E731

        def step():
            forward().backward()
            model.zero_grad(set_to_none=True)

        acts = saved_bytes(forward, model)
        peak = peak_growth(step)
        times = []
        for _ in range(args.rounds):
            if comm is not None:
                comm.barrier()
            start = time.perf_counter()
            step()
            if comm is not None:
                comm.barrier()
            times.append(time.perf_counter() - start)
        results[length] = {"activation_bytes": acts, "peak_growth": peak, "step_s": statistics.median(times)}
    results["longest"] = longest(model, comm, args)
    return results


def longest(model, comm, args) -> int:
    """The longest multiple of 64 tokens whose activation bytes fit the budget (forwards only)."""
    def fits(length: int) -> bool:
        ids = torch.zeros(args.batch, length, dtype=torch.long)
        kwargs = {"use_cache": False} if comm is None else {}
        acts = torch.tensor(float(saved_bytes(lambda: model(input_ids=ids, labels=ids, **kwargs).loss, model)))
        if comm is not None:
            acts = comm.all_reduce(acts, "max")
        return float(acts) <= args.budget

    low, high = 64, 128
    while fits(high):
        low, high = high, high * 2
    while high - low > 64:
        mid = (low + high) // 128 * 64
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def rank_main(comm, args, cp: int, method: str, lengths: list[int]):
    model0 = build(args)
    return measure(comm, args, model0, cp, method, lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=54)
    parser.add_argument("--lengths", type=int, default=3, help="sequence lengths drawn")
    parser.add_argument("--min-seq", type=int, default=1024)
    parser.add_argument("--max-seq", type=int, default=4096)
    parser.add_argument("--budget-seq", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    lengths = sorted(rng.randrange(args.min_seq, args.max_seq) for _ in range(args.lengths))
    torch.set_num_threads(1)
    model0 = build(args)
    args.budget = float("inf")
    ids = torch.zeros(args.batch, args.budget_seq, dtype=torch.long)
    args.budget = saved_bytes(lambda: model0(input_ids=ids, labels=ids, use_cache=False).loss, model0)
    runs = {"cp1": measure(None, args, model0, 1, "-", lengths)}
    for cp in (2, 4):
        for method in ("all_to_all", "ring"):
            runs[f"cp{cp}-{method}"] = tpkit.launch(rank_main, cp, pass_comm=True, args=(args, cp, method, lengths),
                                                    threads=1)
    base = runs["cp1"]
    print(f"Llama hidden {args.hidden} x {args.layers} layers, batch {args.batch}, lengths {lengths} (seed "
          f"{args.seed}); budget: cp1's activations at {args.budget_seq} tokens = {args.budget / 2**20:.1f} MiB")
    print("| setup | tokens | activations / rank (MiB) | x cp1 | peak RSS growth (MiB) | step (s) | x cp1 |")
    print("|---|---|---|---|---|---|---|")
    table = {}
    for name, result in runs.items():
        per_rank = [result] if name == "cp1" else result
        for length in lengths:
            acts = max(r[length]["activation_bytes"] for r in per_rank)
            peak = max(r[length]["peak_growth"] for r in per_rank)
            step = per_rank[0][length]["step_s"]
            table[(name, length)] = (acts, peak, step)
            print(f"| {name} | {length} | {acts / 2**20:.1f} | {acts / base[length]['activation_bytes']:.2f} | "
                  f"{peak / 2**20:.0f} | {step:.3f} | {step / base[length]['step_s']:.2f} |")
    print("| setup | longest sequence in the budget | x cp1 |")
    print("|---|---|---|")
    for name, result in runs.items():
        best = result["longest"] if name == "cp1" else min(r["longest"] for r in result)
        print(f"| {name} | {best} | {best / base['longest']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lengths": lengths, "runs": runs}, f, default=str)


if __name__ == "__main__":
    main()
