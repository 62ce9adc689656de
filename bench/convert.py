"""Benchmark of automatic conversion (issue 4).

1. analyze + plan + parallelize of a Llama-2-7B-shaped model on the meta device (target < 3 s);
2. forward + backward of a small Llama at world size 2 on gloo: tpkit's `parallelize` against Hugging Face's
   `from_pretrained(path, tp_plan="auto")` (DTensor), same saved checkpoint, same inputs, alternating runs,
   medians; target ratio tpkit / HF <= 0.9.

Run: `python bench/convert.py [--repeats 30]`. Prints a markdown block for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch

import tpkit


def meta_conversion(repeats: int) -> dict:
    from tpkit.convert import analyze, parallelize, plan
    from tpkit.estimate.presets import build_model, preset_config

    start = time.perf_counter()
    model = build_model(preset_config("llama-2-7b"), device="meta")
    build_s = time.perf_counter() - start
    parts = {"analyze": [], "plan": [], "parallelize": [], "total": [], "plan_cold": []}
    for _ in range(repeats):
        copies = [copy.deepcopy(model) for _ in range(3)]
        t = time.perf_counter()
        plan(copies[2], 2)  # a fresh model: traces its forward (the figure without the per-model cache)
        parts["plan_cold"].append(time.perf_counter() - t)
        t0 = time.perf_counter()
        analyze(copies[0], max_world_size=8, device_memory="80GB")
        t1 = time.perf_counter()
        plan(copies[0], 2)
        t2 = time.perf_counter()

        def body(comm):
            parallelize(copies[comm.rank], "auto", comm)
            comm.barrier()
        tpkit.comm.run_threads(body, 2)
        t3 = time.perf_counter()
        for k, v in zip(("analyze", "plan", "parallelize", "total"), (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            parts[k].append(v)
    q = copies[0].model.layers[0].self_attn.q_proj
    return {"build_s": build_s, **{k: statistics.median(v) for k, v in parts.items()},
            "check": f"rank 0 q_proj {type(q).__name__} {tuple(q.weight.shape)} on {q.weight.device}"}


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                       tie_word_embeddings=False)


def _fwd_bwd(model, ids) -> tuple[float, float]:
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return time.perf_counter() - start, loss.item()


def gloo_body(path: str, repeats: int) -> dict:
    import warnings

    from transformers import LlamaForCausalLM

    from tpkit.convert import parallelize

    warnings.filterwarnings("ignore")
    comm = tpkit.get_communicator()
    ids = torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(0))
    hf = LlamaForCausalLM.from_pretrained(path, tp_plan="auto")
    ours_train = parallelize(LlamaForCausalLM.from_pretrained(path), comm=comm, mode="training")
    ours_gather = parallelize(LlamaForCausalLM.from_pretrained(path), comm=comm, mode="inference")
    models = {"hf": hf, "tpkit_training": ours_train, "tpkit_gathered": ours_gather}
    times = {k: [] for k in models}
    losses = {}
    for i in range(repeats + 3):
        for name, m in models.items():  # alternate every repeat
            m.zero_grad(set_to_none=True)
            comm.barrier()
            t, loss = _fwd_bwd(m, ids)
            if i >= 3:  # warm-up
                times[name].append(t)
            losses[name] = loss
    return {"median": {k: statistics.median(v) for k, v in times.items()}, "losses": losses}


def hf_comparison(repeats: int) -> dict:
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        LlamaForCausalLM(_config()).save_pretrained(path)
        results = tpkit.launch(gloo_body, 2, backend="gloo", args=(path, repeats), timeout=600)
    med = {k: max(r["median"][k] for r in results) for k in results[0]["median"]}
    return {"median_s": med, "losses": results[0]["losses"],
            "ratio_training": med["tpkit_training"] / med["hf"], "ratio_gathered": med["tpkit_gathered"] / med["hf"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--meta-repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    meta = meta_conversion(args.meta_repeats)
    print(f"meta Llama-2-7B: build {meta['build_s']:.2f} s (not counted); analyze {meta['analyze']:.2f} s + plan "
          f"{meta['plan']:.2f} s + parallelize (2 thread-ranks) {meta['parallelize']:.2f} s = {meta['total']:.2f} s "
          f"(median of {args.meta_repeats}; target < 3 s) [{meta['check']}]; plan of a fresh model (no cached "
          f"trace) {meta['plan_cold']:.2f} s")
    hf = hf_comparison(args.repeats)
    m = hf["median_s"]
    print(f"small Llama fwd+bwd, 2 gloo ranks, median of {args.repeats}: HF tp_plan=auto {m['hf'] * 1e3:.1f} ms; "
          f"tpkit training plan (vocab-parallel loss) {m['tpkit_training'] * 1e3:.1f} ms (ratio "
          f"{hf['ratio_training']:.2f}); tpkit gathered-logits plan {m['tpkit_gathered'] * 1e3:.1f} ms (ratio "
          f"{hf['ratio_gathered']:.2f}); losses {hf['losses']}")


if __name__ == "__main__":
    main()
