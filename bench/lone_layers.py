"""What splitting lone layers alone costs and saves (issue 24): per-rank parameters and forward time at TP2, the
planner's default (large layers without a partner split by output features, output all-gathered: `colwise_rep`)
against the alternative the setup search offers (`lone_layers: whole`, i.e. those layers replicated).

Models (random weights, float32, built from configs): a Mamba (its mixers' `in_proj` / `out_proj` have no partner
the trace can prove), a BERT masked LM (its head's transform dense), and a Llama with fewer heads than ranks (its attention
projections). Each runs on 2 gloo processes (`tpkit.launch`, one thread each); a forward on a batch of
`--batch` x `--seq` tokens is timed `--repeats` times per variant, the variants alternating, median per variant.

    python bench/lone_layers.py [--batch 4] [--seq 128] [--repeats 15]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def models() -> dict:
    import transformers as tr

    return {
        "Mamba (hidden 512, 4 layers)": lambda: tr.MambaForCausalLM(tr.MambaConfig(
            vocab_size=8000, hidden_size=512, num_hidden_layers=4, state_size=16)),
        "BERT MLM (hidden 512, 4 layers)": lambda: tr.BertForMaskedLM(tr.BertConfig(
            vocab_size=8000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048)),
        "Llama, 1 head at TP2 (hidden 512, 4 layers)": lambda: tr.LlamaForCausalLM(tr.LlamaConfig(
            vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=1,
            num_key_value_heads=1, head_dim=512)),
    }


def _rank(name: str, batch: int, seq: int, repeats: int) -> dict:
    import tpkit

    comm = tpkit.get_communicator()
    torch.manual_seed(0)
    model = models()[name]().float().eval()
    ids = torch.randint(3, 8000, (batch, seq), generator=torch.Generator().manual_seed(1))
    default = tpkit.plan(model, comm.world_size, example_inputs={"input_ids": ids[:1, :8]})
    whole = {n: "replicate" for n in default.split_alone()}
    variants = {"split alone": tpkit.parallelize(copy.deepcopy(model), default, comm),
                "whole": tpkit.parallelize(copy.deepcopy(model), default.updated(tpkit.Plan(whole)), comm)}
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in variants.items()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.inference_mode():
        for m in variants.values():
            m(input_ids=ids)
        for _ in range(repeats):
            for k, m in variants.items():
                comm.barrier()
                start = time.perf_counter()
                m(input_ids=ids)
                comm.barrier()
                times[k].append(time.perf_counter() - start)
    full = sum(p.numel() for p in model.parameters())
    return {"layers": len(whole), "full": full, "params": params,
            "ms": {k: statistics.median(v) * 1e3 for k, v in times.items()}}


def main() -> None:
    import tpkit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    print(f"| model | layers split alone | params per rank: split alone / whole (share) | forward ms: split alone "
          f"/ whole (ratio) |\n|---|---:|---|---|")
    for name in models():
        r = tpkit.launch(_rank, 2, args=(name, args.batch, args.seq, args.repeats))[0]
        p, ms = r["params"], r["ms"]
        print(f"| {name} | {r['layers']} | {p['split alone'] / 1e6:.2f}M / {p['whole'] / 1e6:.2f}M "
              f"({p['split alone'] / r['full']:.2f} / {p['whole'] / r['full']:.2f}) | {ms['split alone']:.1f} / "
              f"{ms['whole']:.1f} ({ms['split alone'] / ms['whole']:.2f}x) |", flush=True)


if __name__ == "__main__":
    main()
