"""Decode speed and load time of a quantized checkpoint at TP2, against the same model in float32 at TP2 and
against transformers' single-process load of the quantized directory.

A random Llama (hidden `--hidden`, MLP 2.75 x hidden, head dim 128, `--layers` layers, vocabulary 8000, fp32) is
quantized by compressed-tensors to int4, group 128, asymmetric (`pack-quantized`; lm_head left dense, as
llm-compressor's recipes do) and also saved dense, once, to a temporary directory (shapes drawn from nothing
tuned: the defaults are the issue's). Then, in 2 gloo processes (`tpkit.launch`, one thread each), each rank
loads both with `tpkit.from_pretrained` (load time: the slower rank) and alternates their greedy decode timing
(ms/token = (generate N tokens - generate 1) / (N - 1), median of `--repeats`); in one process, transformers
loads the quantized directory (`CompressedTensorsConfig(dequantize=True)`: its CPU path) and decodes likewise.
Prints a markdown block for BENCHMARKS.md.

    python bench/quantized.py [--hidden 2048] [--layers 2] [--tokens 9] [--repeats 3]
    python bench/quantized.py --kernels [--hidden 2048]   # one MLP-sized layer, batch 1, 1 thread
    python bench/quantized.py --formats                   # exactness and bytes per format, 2 and 3 thread-ranks

`--kernels` times what a decode step of one layer (`out` = 2.75 x hidden, `in` = hidden, group 128) can cost per
call: tpkit's dequantization of the packed int4 slice, torch's CPU weight-only kernels on their own packed layouts
(`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`), and the float32 matrix-vector product they replace.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB = 8000


def make(directory: str, hidden: int, layers: int) -> tuple[str, str]:
    import transformers as tr

    from tests.quant.checkpoints import compressed_tensors

    config = tr.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 128 * 128,
                            num_hidden_layers=layers, num_attention_heads=hidden // 128,
                            num_key_value_heads=max(hidden // 512, 1), max_position_embeddings=256)
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(config).eval()
    dense = os.path.join(directory, "fp32")
    model.save_pretrained(dense)
    int4 = compressed_tensors(model, os.path.join(directory, "int4"), "pack-quantized", num_bits=4, type="int",
                              symmetric=False, strategy="group", group_size=128)
    return dense, int4


def ms_per_token(model, tokens: int) -> float:
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    return (run(tokens) - run(1)) / (tokens - 1) * 1e3


def _status(field: str) -> int:
    """A byte figure of /proc/self/status (VmRSS: resident now; VmHWM: the peak since the last reset)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> int:
    """Reset the process's peak RSS to its current RSS (Linux: clear_refs 5) and return the current RSS; a process
    forked from one that built the model starts with that model's peak, which would hide the load's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _tp_rank(dense: str, int4: str, tokens: int, repeats: int) -> dict:
    import tpkit

    torch.set_num_threads(1)
    out = {}
    models = {}
    for name, path in (("int4", int4), ("fp32", dense)):
        before = _reset_peak()
        start = time.perf_counter()
        models[name] = tpkit.from_pretrained(path, progress=False)
        out[f"load_{name}"] = time.perf_counter() - start
        out[f"rss_{name}"] = _status("VmHWM") - before
    for m in models.values():
        ms_per_token(m, 3)  # warm-up
    samples = {n: [] for n in models}
    for _ in range(repeats):
        for n, m in models.items():  # alternating
            samples[n].append(ms_per_token(m, tokens))
    out.update({f"decode_{n}": statistics.median(v) for n, v in samples.items()})
    out["bytes_int4"] = sum(t.numel() * t.element_size() for t in models["int4"].state_dict().values())
    out["bytes_fp32"] = sum(t.numel() * t.element_size() for t in models["fp32"].state_dict().values())
    return out


def transformers_one_process(int4: str, tokens: int, repeats: int) -> dict:
    import transformers as tr

    torch.set_num_threads(1)
    start = time.perf_counter()
    model = tr.AutoModelForCausalLM.from_pretrained(
        int4, quantization_config=tr.CompressedTensorsConfig(dequantize=True)).eval()
    load = time.perf_counter() - start
    ms_per_token(model, 3)
    return {"load": load, "decode": statistics.median(ms_per_token(model, tokens) for _ in range(repeats))}


def kernels(hidden: int, repeats: int = 20) -> str:
    from tpkit.quant import WeightQuant, dequantize, stored_tensors
    from tpkit.quant.kernels import int4_linear
    from tpkit.quant.packing import unpack_signed

    torch.set_num_threads(1)
    O, I, g = int(hidden * 2.75) // 128 * 128, hidden, 128
    gen = torch.Generator().manual_seed(0)
    q = WeightQuant("compressed-tensors", "ct_pack", 4, False, "group", group_size=g)
    specs = {s.name: s for s in stored_tensors(q, O, I)}
    t = {"weight_packed": torch.randint(-2 ** 31, 2 ** 31 - 1, (O, I // 8), dtype=torch.int32, generator=gen),
         "weight_scale": torch.rand(O, I // g, generator=gen),
         "weight_zero_point": torch.randint(-2 ** 31, 2 ** 31 - 1, (O // 8, I // g), dtype=torch.int32, generator=gen),
         "weight_shape": torch.tensor([O, I])}
    x, w = torch.randn(1, I, generator=gen), torch.randn(O, I, generator=gen)
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (O, I), dtype=torch.int32), 1)
    sz, w8, s8 = torch.rand(I // g, O, 2), torch.randint(-128, 127, (O, I), dtype=torch.int8), torch.rand(O)
    calls = {"float32 x @ W.T": lambda: x @ w.t(),
             "tpkit dequantize int4 g128 + matmul": lambda: x @ dequantize(q, specs, t, {}, (O, I), torch.float32).t(),
             "tpkit int4 layer (words rearranged + torch's int4 kernel)": lambda: int4_linear(
                 x, t["weight_packed"], t["weight_scale"], unpack_signed(t["weight_zero_point"], 4, 0), g),
             "torch _weight_int4pack_mm_for_cpu": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4, g, sz),
             "torch _weight_int8pack_mm": lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8)}
    times = {}
    for _ in range(3):  # alternating rounds, the median of each
        for name, f in calls.items():
            f()
            start = time.perf_counter()
            for _ in range(repeats):
                f()
            times.setdefault(name, []).append((time.perf_counter() - start) / repeats * 1e3)
    base = statistics.median(times["float32 x @ W.T"])
    rows = [f"| {n} | {statistics.median(v):.2f} | {statistics.median(v) / base:.1f}x |" for n, v in times.items()]
    return "\n".join([f"One layer [{O} x {I}], batch 1, 1 thread:", "", "| call | ms | / float32 |", "|---|---|---|"]
                     + rows)


def formats() -> str:
    """Per format of tests/quant (the checkpoints made the ecosystem's way): the worst logits error against
    transformers' load of the directory, whether every rank's dequantized weight is the exact slice, and the
    quantized tensors' bytes a rank holds over the file's bytes of those layers times the rank's share of each dense
    weight (1.0: no overhead beyond the split itself; the worst rank)."""
    import tpkit
    from tpkit.comm import run_threads
    from tpkit.nn.quantized import quant_method_of
    from tests.quant import test_checkpoints as T

    rows = ["| format | ranks | logits rel err | weights exact | stored bytes / its dense share of the file's | kernel |",
            "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        bases = {"llama": T.C.llama(), "qwen2": T.C.qwen2(), "phi3": T.C.phi3()}
        made: dict[str, tuple[str, str | None]] = {}

        def directory(name: str) -> str:
            if name not in made:
                model, maker = T.FORMATS[name]
                made[name] = maker(os.path.join(tmp, name), bases[model], directory)
            return made[name][0]

        for name in sorted(T.FORMATS):
            d = directory(name)
            ref = T.C.reference(d, made[name][1])
            with torch.no_grad():
                want = ref(T.IDS).logits
            dense = ref.state_dict()
            for world in (2, 3):
                def body(comm):
                    model = tpkit.from_pretrained(d, comm=comm, progress=False)
                    with torch.no_grad():
                        err = T._rel(model(T.IDS).logits, want)
                    exact, local, full, kernels = True, 0, 0, set()
                    for n, m in model.named_modules():
                        st = quant_method_of(m)
                        if st is not None:
                            exact &= torch.equal(m.weight, st.dense.shard(dense[f"{n}.weight"]))
                            kernels.add(st.kernel)
                            share = st.dense.local_numel / torch.Size(st.dense.full_shape).numel()
                            for s in st.specs:
                                t = m._buffers[s]
                                local += t.numel() * t.element_size()
                                full += torch.Size(st.specs[s].shape).numel() * t.element_size() * share
                    return err, exact, local / full, kernels

                res = run_threads(body, world)
                kern = sorted({k for r in res for k in r[3] if k}) or ["-"]
                rows.append(f"| {name} | {world} | {max(r[0] for r in res):.1e} | "
                            f"{'yes' if all(r[1] for r in res) else 'NO'} | {max(r[2] for r in res):.3f} | "
                            f"{', '.join(kern)} |")
    return "\n".join(rows)


def main() -> None:
    import tpkit

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--formats", action="store_true")
    args = ap.parse_args()
    if args.kernels:
        print(kernels(args.hidden))
        return
    if args.formats:
        print(formats())
        return
    with tempfile.TemporaryDirectory() as tmp:
        dense, int4 = make(tmp, args.hidden, args.layers)
        ranks = tpkit.launch(_tp_rank, 2, args=(dense, int4, args.tokens, args.repeats))
        hf = transformers_one_process(int4, args.tokens, args.repeats)
    r = {k: max(x[k] for x in ranks) for k in ranks[0]}
    rows = [("tpkit TP2 int4 g128 (packed; int4 kernel where a layer maps onto it)", r["decode_int4"], r["load_int4"],
             r["bytes_int4"]),
            ("tpkit TP2 float32", r["decode_fp32"], r["load_fp32"], r["bytes_fp32"]),
            ("transformers 1 process int4 (dequantize=True)", hf["decode"], hf["load"], None)]
    lines = [f"| {n} | {d:.1f} | {l:.2f} | {'' if b is None else f'{b / 2 ** 20:.0f} MiB'} |" for n, d, l, b in rows]
    table = "\n".join(["| setup | decode ms/token | load s | bytes per rank |", "|---|---|---|---|"] + lines)
    ratio = r["decode_int4"] / r["decode_fp32"]
    table += (f"\n\nPeak RSS added while loading, the worse rank: int4 {r['rss_int4'] / 2 ** 20:.0f} MiB (its tensors "
              f"{r['bytes_int4'] / 2 ** 20:.0f} MiB), float32 {r['rss_fp32'] / 2 ** 20:.0f} MiB (its tensors "
              f"{r['bytes_fp32'] / 2 ** 20:.0f} MiB)")
    text = (f"{table}\n\nint4 decode at TP2 / float32 at TP2: **{ratio:.2f}x** (target <= 1.00); hidden {args.hidden}, "
            f"{args.layers} layers, {args.tokens} tokens, median of {args.repeats}, 1 thread per rank; "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{datetime.date.today().isoformat()}.")
    print(text)


if __name__ == "__main__":
    main()
