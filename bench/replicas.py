"""The replica sentinel (issue 35): what one check costs beside a training step, and clean runs that must never
raise.

cost: a 4-layer Llama (hidden 256, 8 heads / 4 KV heads, float32) at TP2 on gloo processes (one thread each),
a training step (batch 4 x 128, AdamW), `check_replicas` (gradients and parameters) and one check of the forward
sentinel a converted model runs itself (`tpkit.nn.sentinel.check`: inputs, replicated tensors, split samples) timed
alternately, `--repeats` times each, median per side; the ratios, and the share of a run at `every=50`.

soak: `--steps` clean training steps at TP 2 and 3 on gloo processes, every step checked (`watch_replicas(every=1)`),
with dropout 0.1, full recompute, two micro-batches of gradient accumulation and bf16 autocast; a tiny Llama
(8 query / 2 KV heads: KV rows shared at 3 ranks) and a tiny GPT-2 (residual dropout on replicated activations).
Any `ReplicaError` is a false positive (or a real divergence) and fails the run.

    python bench/replicas.py cost [--repeats 20]
    python bench/replicas.py soak [--steps 1000]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.replica_soak import llama, soak_body  # noqa: E402


def _cost_body(repeats: int) -> dict:
    import tpkit
    from tpkit.nn import record_of, sentinel, vocab_parallel_cross_entropy

    torch.set_num_threads(1)
    comm = tpkit.get_communicator()
    model = tpkit.parallelize(llama(256, 4, 8, 4), comm=comm, mode="training").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(1))

    def step():
        opt.zero_grad()
        logits = model(input_ids=ids).logits
        vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], vocab_size=1000).backward()
        opt.step()

    def check():
        tpkit.check_replicas(model)

    def forward_check():
        sentinel.check(model, record_of(model), (), {"input_ids": ids})

    for f in (step, check, forward_check):
        f()
    times = {"step": [], "check": [], "sentinel": []}
    for _ in range(repeats):
        for name, f in (("step", step), ("check", check), ("sentinel", forward_check)):
            comm.barrier()
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    report = tpkit.check_replicas(model)
    return {k: statistics.median(v) for k, v in times.items()} | {"tensors": report.tensors, "bytes": report.bytes}


def main() -> None:
    import tpkit

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("cost", "soak"))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    if args.what == "cost":
        res = tpkit.launch(_cost_body, 2, backend="gloo", args=(args.repeats,), timeout=1200)
        step, check, forward = (max(r[k] for r in res) for k in ("step", "check", "sentinel"))
        print(f"TP2 Llama hidden 256, 4 layers: step {step * 1e3:.1f} ms, check {check * 1e3:.2f} ms "
              f"({check / step:.3f} of a step; {check / step / 50:.4%} of a run at every=50, "
              f"{res[0]['tensors']} tensors, {res[0]['bytes'] / 2**20:.2f} MiB per rank); forward sentinel check "
              f"{forward * 1e3:.2f} ms ({forward / step:.3f} of a step; {forward / step / 50:.4%} of a run at its "
              f"every=50)")
        return
    for arch in ("llama", "gpt2"):
        for world in (2, 3):
            t = time.perf_counter()
            checks = tpkit.launch(soak_body, world, backend="gloo", args=(arch, args.steps), timeout=3600)
            print(f"{arch} TP{world}: {args.steps} steps, {checks[0]} checks, no ReplicaError "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
