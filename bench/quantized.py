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


def _tp_rank(dense: str, int4: str, tokens: int, repeats: int) -> dict:
    import tpkit

    torch.set_num_threads(1)
    out = {}
    models = {}
    for name, path in (("int4", int4), ("fp32", dense)):
        start = time.perf_counter()
        models[name] = tpkit.from_pretrained(path, progress=False)
        out[f"load_{name}"] = time.perf_counter() - start
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


def main() -> None:
    import tpkit

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dense, int4 = make(tmp, args.hidden, args.layers)
        ranks = tpkit.launch(_tp_rank, 2, args=(dense, int4, args.tokens, args.repeats))
        hf = transformers_one_process(int4, args.tokens, args.repeats)
    r = {k: max(x[k] for x in ranks) for k in ranks[0]}
    rows = [("tpkit TP2 int4 g128 (packed, dequantized per call)", r["decode_int4"], r["load_int4"],
             r["bytes_int4"]),
            ("tpkit TP2 float32", r["decode_fp32"], r["load_fp32"], r["bytes_fp32"]),
            ("transformers 1 process int4 (dequantize=True)", hf["decode"], hf["load"], None)]
    lines = [f"| {n} | {d:.1f} | {l:.2f} | {'' if b is None else f'{b / 2 ** 20:.0f} MiB'} |" for n, d, l, b in rows]
    table = "\n".join(["| setup | decode ms/token | load s | bytes per rank |", "|---|---|---|---|"] + lines)
    ratio = r["decode_int4"] / r["decode_fp32"]
    text = (f"{table}\n\nint4 decode at TP2 / float32 at TP2: **{ratio:.2f}x** (target <= 1.00); hidden {args.hidden}, "
            f"{args.layers} layers, {args.tokens} tokens, median of {args.repeats}, 1 thread per rank; "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{datetime.date.today().isoformat()}.")
    print(text)


if __name__ == "__main__":
    main()
