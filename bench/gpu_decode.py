"""Greedy decode at world 1 on a GPU in five formats against that GPU's memory limit (issue 56 item 6), with the
quantized layers' fused decode product (`tpkit.quant.fused`) against the dequantized product they took before.

A random Llama is drawn from `--seed` (hidden 3072-4096, MLP 2.5-3.5x, 3-5 layers; head dim 128; vocabulary 8000;
printed) and saved, as `bench/quantized.py` makes them, in float32, bf16 and compressed-tensors int8 channel /
int4 group 128 / FP8 channel of the bf16 model (LM head dense bf16). Each loads with `tpkit.from_pretrained(device=
"cuda")` on a one-rank NCCL group. Per format and product path (`tpkit.quant.fused.set_policy`; one path for
the dense formats), alternating rounds, medians:
- wall ms/token of greedy `generate` ((N tokens - 1 token) / (N - 1)): what a user sees, Python and launches in it;
- GPU ms per decode step: the kernels' own time (torch.profiler, CUDA activity) over 5 steps with a KV cache, so the
  products' distance from the memory limit shows apart from the launch cost;
- transformers' own bf16 model on the same device, the peer;
- bytes a decode step reads (every tensor held, less the embedding table but its row) over the read bandwidth
  measured in the same run (a bf16 sum over 4 GiB, CUDA events): the memory limit.
The fused path's logits are checked against the dequantized path's on the same prompt. `--small` draws a model a
CPU can run (the flow checked without a GPU: `--device cpu`).

    python bench/gpu_decode.py [--seed N] [--tokens 17] [--rounds 3] [--out DIR] [--small --device cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from quantized import VOCAB, bytes_per_token, heads_of, make  # noqa: E402

QUANTIZED = ("int8", "int4", "fp8")
PATHS = ("measured", "generic", "words", "dequant")  # a quantized layer's product: `fused.set_policy` "" / forced / "0"


def setting(way: str) -> None:
    from tpkit.quant import fused

    fused.set_policy({"measured": "", "dense": "", "dequant": "0"}.get(way, way))


def layer_error(model, device: torch.device) -> float:
    """One quantized MLP layer's output for one random row, against float64 of the layer's own dense weight."""
    from tpkit.nn.quantized import quant_method_of

    layer = next(m for n, m in model.named_modules() if n.endswith("down_proj") and quant_method_of(m) is not None)
    x = torch.randn(1, layer.in_features, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)
    with torch.no_grad():
        want = x.double() @ layer.weight.double().t()
        return rel(layer(x), want)


def draw(seed: int, small: bool) -> dict:
    rng = random.Random(seed)
    hidden = rng.choice([256, 384]) if small else rng.choice([3072, 3584, 4096])
    return {"hidden": hidden, "mlp": int(hidden * rng.uniform(2.5, 3.5)) // 256 * 256,
            "layers": rng.randint(2, 3) if small else rng.randint(3, 5)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second a sum over `nbytes` of bf16 reads (median of 10 after 2 warm-ups)."""
    t = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    rates = []
    for i in range(12):
        sync(device)
        start = time.perf_counter()
        t.sum()
        sync(device)
        if i >= 2:
            rates.append(t.nbytes / (time.perf_counter() - start))
    del t
    return statistics.median(rates)


def wall_ms(model, ids: torch.Tensor, tokens: int) -> float:
    def run(n: int) -> float:
        sync(ids.device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(ids.device)
        return time.perf_counter() - start

    return (run(tokens) - run(1)) / (tokens - 1) * 1e3


def kernel_ms(model, ids: torch.Tensor, steps: int = 5) -> float:
    """The GPU's own time per decode step (profiled kernels and copies, not the launches' gaps)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        out = model(ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        sync(ids.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                out = model(nxt, past_key_values=cache, use_cache=True)
                cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            sync(ids.device)
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / steps / 1e3


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def measure(paths: dict, device: torch.device, comm, tokens: int, rounds: int) -> tuple[dict, list]:
    """Every format's figures (see the module docstring), rounds alternating over formats and paths."""
    import tpkit

    # a 12-token prompt: its prefill (over `MAX_ROWS` rows) takes the dequantized product, not a second compile
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1)).to(device)
    models, out = {}, {}
    for name, path in paths.items():
        sync(device)
        start = time.perf_counter()
        models[name] = tpkit.from_pretrained(path, comm=comm, device=device, progress=False)
        sync(device)
        out[f"load_{name}"] = time.perf_counter() - start
        out[f"bytes_{name}"] = bytes_per_token(models[name])
        print(f"loaded {name} in {out[f'load_{name}']:.1f} s", flush=True)
    import transformers as tr

    start = time.perf_counter()  # the peer: transformers' own bf16 model on the device
    models["transformers bf16"] = tr.AutoModelForCausalLM.from_pretrained(paths["bf16"], dtype=torch.bfloat16).to(
        device).eval()
    sync(device)
    out["load_transformers bf16"] = time.perf_counter() - start
    out["bytes_transformers bf16"] = bytes_per_token(models["transformers bf16"])
    ways = [(n, w) for n in models for w in (PATHS if n in QUANTIZED else ("dense",))]
    for n, w in ways:  # warm-up: the fused kernels compile here (first call of each shape), timed
        setting(w)
        start = time.perf_counter()
        wall_ms(models[n], ids, 3)
        out[f"warm_{n}_{w}"] = time.perf_counter() - start
        print(f"first calls of {n} {w}: {out[f'warm_{n}_{w}']:.1f} s", flush=True)
        with torch.inference_mode():
            out[f"logits_{n}_{w}"] = models[n](ids[:, :1]).logits.float().cpu()
        if n in QUANTIZED:
            out[f"layer_{n}_{w}"] = layer_error(models[n], device)
    for n in QUANTIZED:
        if n in models:
            for w in PATHS[:-1]:
                out[f"err_{n}_{w}"] = rel(out.pop(f"logits_{n}_{w}"), out[f"logits_{n}_dequant"])
    out = {k: v for k, v in out.items() if not k.startswith("logits_")}
    samples = {way: ([], []) for way in ways}
    for _ in range(rounds):
        for (n, w), (walls, kernels) in samples.items():
            setting(w)
            walls.append(wall_ms(models[n], ids, tokens))
            if device.type == "cuda":
                kernels.append(kernel_ms(models[n], ids))
    for (n, w), (walls, kernels) in samples.items():
        out[f"wall_{n}_{w}"] = statistics.median(walls)
        out[f"kernel_{n}_{w}"] = statistics.median(kernels) if kernels else float("nan")
    setting("measured")
    return out, ways


def table(r: dict, ways, bandwidth: float) -> str:
    rows = ["| format | product | wall ms/token | GPU ms/step | read per step | memory limit ms | wall / limit | "
            "GPU / limit | load s |", "|---|---|---|---|---|---|---|---|---|"]
    for n, w in ways:
        limit = r[f"bytes_{n}"] / bandwidth * 1e3
        wall, kern = r[f"wall_{n}_{w}"], r[f"kernel_{n}_{w}"]
        rows.append(f"| {n} | {w} | {wall:.2f} | {kern:.3f} | {r[f'bytes_{n}'] / 2 ** 20:.0f} MiB | {limit:.3f} | "
                    f"{wall / limit:.2f}x | {kern / limit:.2f}x | {r[f'load_{n}']:.1f} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=17)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="a folder for the markdown and json results")
    args = ap.parse_args()
    import tpkit

    device = torch.device(args.device)
    seed = args.seed if args.seed is not None else int(time.time()) % 10000
    shape = draw(seed, args.small)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; seed {seed}: {shape}", flush=True)
    comm = tpkit.init("nccl" if device.type == "cuda" else "gloo")
    size = (4 << 30) if device.type == "cuda" else (256 << 20)
    bandwidth = read_bandwidth(device, size)
    print(f"read bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        paths = make(tmp, shape, str(device))
        made = time.perf_counter() - start
        print(f"checkpoints made in {made:.0f} s", flush=True)
        r, ways = measure(paths, device, comm, args.tokens, args.rounds)
    tpkit.shutdown()
    heads = " / ".join(map(str, heads_of(shape)))
    text = (f"{table(r, ways, bandwidth)}\n\nLlama hidden {shape['hidden']}, MLP {shape['mlp']}, {shape['layers']} "
            f"layers, {heads} heads, vocabulary {VOCAB} (seed {seed}); world 1 on {name}; {args.tokens} tokens, "
            f"median of {args.rounds} alternating rounds; read bandwidth {bandwidth / 1e9:.0f} GB/s (bf16 sum over "
            f"{size >> 20} MiB); checkpoints made in {made:.0f} s; one row's logits against the dequantized product's, "
            f"rel: " + ", ".join(f"{k[4:]} {v:.1e}" for k, v in r.items() if k.startswith("err_"))
            + "; one down_proj's row against float64 of its dense weight, rel: "
            + ", ".join(f"{k[6:]} {v:.1e}" for k, v in r.items() if k.startswith("layer_"))
            + "; first calls (compiles) " + ", ".join(f"{n} {w} {r[f'warm_{n}_{w}']:.1f} s" for n, w in ways) + ".")
    print(text, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_decode.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "gpu_decode.json"), "w") as f:
            json.dump({"device": name, "seed": seed, "shape": shape, "bandwidth": bandwidth,
                       "results": {k: v for k, v in r.items() if isinstance(v, (int, float))}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
