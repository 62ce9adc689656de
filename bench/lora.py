"""One LoRA training step at TP2 against the base model's training step on the same batch (issue 37).

Two gloo processes (`tpkit.launch`), a Llama built from a config (float32, no download), converted for training
(logits split over the vocabulary, `vocab_parallel_cross_entropy`). Per step, alternating one by one, median of
`--steps` pairs:

- base: every parameter trains (forward, backward, AdamW);
- lora: PEFT LoRA (r=`--r` on q/k/v/o/gate/up/down) on the same converted model, only the adapter trains;
- the forward alone of each (the adapter's share of the forward: (lora - base) / lora).

The collectives of one step of each are counted with tpkit's profiler (op, count, bytes): the adapter adds none
to the forward; its backward has one gradient sum per whole factor, and skips the input-gradient all-reduces the
frozen layers before the first adapter no longer need.

    python bench/lora.py                 # defaults: hidden 512, 4 layers, batch 4 x 128 tokens, 20 pairs
"""
from __future__ import annotations

import argparse
import collections
import copy
import json
import statistics
import time

import torch

import tpkit

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(args):
    import transformers as tr

    config = tr.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                            num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                            max_position_embeddings=args.seq)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(config)


def loss_of(model, ids, vocab):
    logits = model(input_ids=ids).logits
    return tpkit.vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], vocab_size=vocab)


def rank(base, args) -> dict:
    import peft

    comm = tpkit.get_communicator()
    torch.set_num_threads(1)
    prof = tpkit.CommProfiler(comm)
    plain = tpkit.parallelize(copy.deepcopy(base), comm=prof, mode="training")
    lora = tpkit.parallelize(copy.deepcopy(base), comm=prof, mode="training")
    torch.manual_seed(1)
    lora = peft.get_peft_model(lora, peft.LoraConfig(r=args.r, lora_alpha=2 * args.r, target_modules=TARGETS))
    opts = {"base": torch.optim.AdamW(plain.parameters(), lr=1e-5),
            "lora": torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-5)}
    models = {"base": plain, "lora": lora}
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(2))

    def step(name):
        loss = loss_of(models[name], ids, args.vocab)
        loss.backward()
        opts[name].step()
        opts[name].zero_grad()

    def forward(name):
        with torch.no_grad():
            loss_of(models[name], ids, args.vocab)

    counts = {}
    for name in models:
        step(name)  # warm-up
        prof._root._records.clear()
        loss = loss_of(models[name], ids, args.vocab)
        fwd = list(prof.records)
        prof._root._records.clear()
        loss.backward()
        bwd = list(prof.records)
        opts[name].zero_grad()
        counts[name] = {phase: {op: [sum(1 for r in recs if r.op == op), sum(r.bytes for r in recs if r.op == op)]
                                for op in sorted({r.op for r in recs})} for phase, recs in (("forward", fwd),
                                                                                             ("backward", bwd))}
    prof.enabled = False
    times = collections.defaultdict(list)
    for i in range(args.steps):
        order = ("base", "lora") if i % 2 == 0 else ("lora", "base")
        for what, fn in (("step", step), ("forward", forward)):
            for name in order:
                comm.barrier()
                t = time.perf_counter()
                fn(name)
                times[name, what].append(time.perf_counter() - t)
    trainable = {n: sum(p.numel() for p in m.parameters() if p.requires_grad) for n, m in models.items()}
    return {"times": {f"{k[0]}_{k[1]}": v for k, v in times.items()}, "counts": counts, "trainable": trainable}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="timed pairs")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    base = build(args)
    results = tpkit.launch(rank, 2, backend="gloo", args=(base, args))
    r0 = results[0]
    med = {k: statistics.median(v) for k, v in r0["times"].items()}
    pair = {what: statistics.median(a / b for a, b in zip(r0["times"][f"lora_{what}"], r0["times"][f"base_{what}"]))
            for what in ("step", "forward")}
    print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, batch {args.batch} x {args.seq}, "
          f"LoRA r={args.r} on {','.join(TARGETS)}; TP2 on 2 gloo processes, float32, median of {args.steps} pairs")
    print(f"trainable parameters on rank 0: base {r0['trainable']['base']}, lora {r0['trainable']['lora']}")
    print(f"training step: base {med['base_step'] * 1e3:.1f} ms, lora {med['lora_step'] * 1e3:.1f} ms, "
          f"median pair ratio lora / base {pair['step']:.3f}")
    print(f"forward: base {med['base_forward'] * 1e3:.1f} ms, lora {med['lora_forward'] * 1e3:.1f} ms, pair ratio "
          f"{pair['forward']:.3f} (the adapter's share of the forward: {1 - 1 / pair['forward']:.3f})")
    for name in ("base", "lora"):
        for phase in ("forward", "backward"):
            ops = ", ".join(f"{op} x{n} ({b / 1e6:.2f} MB)" for op, (n, b) in r0["counts"][name][phase].items())
            print(f"collectives per step, {name} {phase}: {ops or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "median_s": med, "pair_ratio": pair, "counts": r0["counts"]}, f, indent=1)


if __name__ == "__main__":
    main()
