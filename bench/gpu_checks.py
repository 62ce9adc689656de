"""The checks that need a GPU, in one run on a lent machine: NCCL at world size 1, a converted model's CUDA
paths (exact against the original, compiled, generating), a quantized (FP8 block) checkpoint on CUDA, pinned
host -> device bandwidth, and loading a checkpoint straight onto the device against transformers'
`device_map="cuda"`.

Why one script: a lent GPU is warm for seconds between calls and its time is counted; every check here runs in
one call and prints markdown rows for BENCHMARKS.md (and `--json` writes them). Each check reports its own
failure as a row rather than stopping the others. Load trials run each in a fresh process (this script with
`--load-trial`), alternating tpkit and transformers, the order reversed every other rep; medians.

    PYTHONPATH=src python bench/gpu_checks.py [--reps 5] [--json out.json] [--skip-load | --load-only]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from checkpoint import PeakRSS  # noqa: E402  (bench/checkpoint.py: RSS sampler)

# (name, hidden, intermediate, layers, heads, kv heads, vocab): fp32 checkpoints of 0.64 and 2.6 GB.
LOAD_MODELS = [("llama-0.64GB", 1024, 2816, 8, 16, 8, 32000), ("llama-2.6GB", 2048, 5632, 12, 16, 8, 32000)]


def llama_config(hidden, inter, layers, heads, kv, vocab):
    import transformers as tr

    return tr.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                          max_position_embeddings=512, tie_word_embeddings=False)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_nccl(comm) -> list[str]:
    """Every collective of a one-rank NCCL group on CUDA tensors returns its input's value (sync and async)."""
    x = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    got = {"all_reduce": comm.all_reduce(x), "all_gather": comm.all_gather(x, dim=1),
           "reduce_scatter": comm.reduce_scatter(x, dim=0), "broadcast": comm.broadcast(x),
           "all_reduce async": comm.all_reduce(x, async_op=True).wait()}
    comm.barrier()
    bad = [k for k, v in got.items() if not (v.is_cuda and torch.equal(v, x))]
    return [f"| NCCL world 1: all_reduce, all_gather, reduce_scatter, broadcast, async all_reduce, barrier on "
            f"CUDA tensors | {'all equal their input' if not bad else 'WRONG: ' + ', '.join(bad)} |"]


def check_converted(comm) -> list[str]:
    """A Llama converted on a one-rank NCCL group on CUDA: forward and every gradient equal the original's
    (fp32), a compiled forward equals eager, and bf16 greedy generation gives transformers' tokens."""
    import copy

    import transformers as tr

    import tpkit

    torch.manual_seed(0)
    ref = tr.LlamaForCausalLM(llama_config(512, 1408, 4, 8, 4, 8000)).cuda()
    model = tpkit.parallelize(copy.deepcopy(ref), comm=comm, mode="training")
    ids = torch.randint(0, 8000, (2, 64), device="cuda")
    out_ref, out = ref(ids, labels=ids), model(ids, labels=ids)
    out_ref.loss.backward()
    out.loss.backward()
    grads = dict(model.named_parameters())
    worst = max(rel(grads[n].grad, p.grad) for n, p in ref.named_parameters())
    rows = [f"| converted Llama (hidden 512, 4 layers) on CUDA, NCCL world 1, fp32 | logits rel "
            f"{rel(out.logits, out_ref.logits):.1e}, worst gradient rel {worst:.1e} |"]
    model.eval()
    compiled = torch.compile(model)
    with torch.no_grad():
        eager, comp = model(ids).logits, compiled(ids).logits
    rows.append(f"| the same, torch.compile (inductor) forward vs eager | rel {rel(comp, eager):.1e} |")
    ref16 = ref.to(torch.bfloat16).eval()
    m16 = tpkit.parallelize(copy.deepcopy(ref16), comm=comm)
    prompt = ids[:1, :16]
    with torch.no_grad():
        a = ref16.generate(prompt, max_new_tokens=24, do_sample=False)
        b = m16.generate(prompt, max_new_tokens=24, do_sample=False)
    rows.append(f"| the same in bf16: greedy generate, 24 new tokens | "
                f"{'tokens equal transformers' if torch.equal(a, b) else 'tokens DIFFER'} |")
    return rows


def check_quantized(comm) -> list[str]:
    """An FP8 block-scaled checkpoint (DeepSeek-V3's format, tests/quant/checkpoints.py) loaded by
    `tpkit.from_pretrained(device="cuda")` on a one-rank NCCL group: logits against transformers' load with
    `FineGrainedFP8Config(dequantize=True)` on CUDA, and greedy decode ms/token against the dense fp32 model (the
    decode products: `tpkit.quant.fused`; `bench/gpu_decode.py` measures them per path)."""
    import tempfile

    import transformers as tr

    import tpkit

    sys.path.insert(0, os.path.dirname(HERE))
    from tests.quant.checkpoints import hf_fp8

    torch.manual_seed(0)
    dense = tr.LlamaForCausalLM(llama_config(512, 1408, 4, 8, 4, 8000)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = hf_fp8(dense, os.path.join(tmp, "fp8"))
        ref = tr.AutoModelForCausalLM.from_pretrained(path, quantization_config=tr.FineGrainedFP8Config(
            dequantize=True), dtype=torch.float32).cuda().eval()
        model = tpkit.from_pretrained(path, comm=comm, device="cuda", dtype=torch.float32)
    ids = torch.randint(0, 8000, (2, 32), device="cuda")
    with torch.no_grad():
        err = rel(model(ids).logits, ref(ids).logits)
    dense = dense.cuda()

    def ms(m) -> float:
        prompt = ids[:1, :8]
        with torch.no_grad():
            for n in (2, 17):
                torch.cuda.synchronize()
                start = time.perf_counter()
                m.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
                torch.cuda.synchronize()
                if n == 2:
                    short = time.perf_counter() - start
        return (time.perf_counter() - start - short) / 15 * 1e3

    q, d = statistics.median(ms(model) for _ in range(3)), statistics.median(ms(dense) for _ in range(3))
    return [f"| FP8 block checkpoint, tpkit.from_pretrained on CUDA (NCCL world 1) vs transformers dequantized | "
            f"logits rel {err:.1e} |",
            f"| the same: greedy decode ms/token, FP8 (dequantized per call) / dense fp32 | {q:.2f} / {d:.2f} = "
            f"{q / d:.2f}x |"]


def check_pinned() -> list[str]:
    from tpkit.comm.pinned import measure_h2d_bandwidth

    bw = measure_h2d_bandwidth(256 << 20, iters=10)
    return [f"| host -> device, 256 MiB (`measure_h2d_bandwidth`) | " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bw.items())
            + " |"]


def load_trial(kind: str, path: str) -> dict:
    """One load in this fresh process: the clock runs until every weight is on the GPU."""
    import transformers as tr
    import transformers.models.llama.modeling_llama  # noqa: F401  (imports paid before the clock, both kinds)

    import tpkit

    comm = tpkit.init("nccl") if kind == "tpkit" else None
    torch.cuda.synchronize()
    with PeakRSS() as m:
        t0 = time.perf_counter()
        if kind == "tpkit":
            model = tpkit.from_pretrained(path, comm=comm, progress=False)
        else:
            model = tr.AutoModelForCausalLM.from_pretrained(path, device_map="cuda", dtype=torch.float32)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    devices = {str(t.device) for t in list(model.parameters()) + list(model.buffers())}
    ids = torch.arange(32, device="cuda").reshape(1, 32)
    with torch.no_grad():
        logits = model(ids).logits.double()
    return {"wall": wall, "peak": m.peak - m.base, "devices": sorted(devices),
            "checksum": [logits.sum().item(), logits.abs().sum().item()], "gpu_bytes": torch.cuda.max_memory_allocated()}


def run_load_trial(kind: str, path: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--load-trial", kind, "--path", path]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} trial failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_load(reps: int) -> list[str]:
    import transformers as tr

    rows = []
    for name, *shape in LOAD_MODELS:
        path = f"/tmp/tpkit-gpu-{name}"
        if not os.path.exists(os.path.join(path, "config.json")):
            torch.manual_seed(0)
            tr.LlamaForCausalLM(llama_config(*shape)).save_pretrained(path)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
        res = {"tpkit": [], "transformers": []}
        for i in range(reps):
            for kind in (("tpkit", "transformers") if i % 2 == 0 else ("transformers", "tpkit")):
                res[kind].append(run_load_trial(kind, path))
        t, h = res["tpkit"], res["transformers"]
        same = t[0]["checksum"] == h[0]["checksum"]
        wall_t, wall_h = statistics.median(r["wall"] for r in t), statistics.median(r["wall"] for r in h)
        peak_t, peak_h = statistics.median(r["peak"] for r in t), statistics.median(r["peak"] for r in h)
        rows.append(f"| load {name} ({size / 1e9:.2f} GB fp32) onto cuda, fresh processes, median of {reps} | tpkit "
                    f"{wall_t:.2f} s vs transformers `device_map=\"cuda\"` {wall_h:.2f} s (**{wall_t / wall_h:.2f}x**); "
                    f"host peak above start {peak_t / size:.2f}x vs {peak_h / size:.2f}x of the checkpoint; devices "
                    f"{t[0]['devices']}; logits {'equal' if same else 'DIFFER'} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--load-only", action="store_true", help="only the loads onto cuda against transformers")
    ap.add_argument("--load-trial", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_trial:
        print(json.dumps(load_trial(args.load_trial, args.path)))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    import tpkit

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| check | result |\n|---|---|")
    comm = tpkit.init("nccl")
    checks = [] if args.load_only else [lambda: check_nccl(comm), lambda: check_converted(comm),
                                        lambda: check_quantized(comm), check_pinned]
    rows = []
    for check in checks:
        try:
            got = check()
        except Exception as exc:  # noqa: BLE001 - a failed check is a row, the others still run
            got = [f"| {getattr(check, '__name__', 'check')} | FAILED: {type(exc).__name__}: {exc} |"]
            traceback.print_exc()
        rows += got
        print("\n".join(got), flush=True)
    tpkit.shutdown()
    if not args.skip_load:
        try:
            got = check_load(args.reps)
        except Exception as exc:  # noqa: BLE001
            got = [f"| load | FAILED: {exc} |"]
        rows += got
        print("\n".join(got), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
