"""Greedy decoding speed (ms per token) of a Llama converted by tpkit at TP2, against transformers' own TP
(`from_pretrained(path, tp_plan="auto")`, DTensor) on the same checkpoint and against one process.

A random Llama (vocab 32000, `--layers` layers, hidden `--hidden`, MLP 2.75 x hidden, head dim 128, fp32) is
saved once to a temporary directory. Each configuration then loads it, warms up, and times
`generate(prompt of 8, greedy, exactly N new tokens)` for N = `--tokens` and N = 1; ms/token is the
difference divided by `--tokens - 1` (the prefill cancels), the median of `--repeats`.

    tpkit TP2          2 gloo processes (tpkit.launch, torchrun's env vars), 1 thread each, parallelize()
    transformers TP2   the same 2 processes' process group, from_pretrained(path, tp_plan="auto"), 1 thread each
    1 proc x 1 thread  / 1 proc x 2 threads: the unconverted model

    python bench/decode.py [--hidden 512,2048] [--layers 4] [--tokens 17] [--repeats 3]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time

import torch


def make_checkpoint(directory: str, hidden: int, layers: int) -> str:
    import transformers as tr

    path = os.path.join(directory, f"llama-{hidden}")
    heads = max(hidden // 128, 2)
    config = tr.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                            max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    tr.LlamaForCausalLM(config).save_pretrained(path)
    return path


def ms_per_token(model, tokens: int, repeats: int) -> float:
    ids = torch.randint(3, 32000, (1, 8), generator=torch.Generator().manual_seed(1))

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    run(3)
    samples = []
    for _ in range(repeats):
        samples.append((run(tokens) - run(1)) / (tokens - 1) * 1e3)
    return statistics.median(samples)


def _load(path: str, **kw):
    import transformers as tr

    model = tr.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    model.generation_config.eos_token_id = None  # always exactly N tokens
    return model.eval()


def _tp_body(path: str, tokens: int, repeats: int, which: str) -> float:
    import tpkit

    torch.set_num_threads(1)
    if which == "tpkit":
        model = tpkit.parallelize(_load(path), comm=tpkit.get_communicator())
    else:
        model = _load(path, tp_plan="auto")
    return ms_per_token(model, tokens, repeats)


def main() -> None:
    import tpkit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", default="512,2048")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=17)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for hidden in [int(h) for h in a.hidden.split(",")]:
            path = make_checkpoint(tmp, hidden, a.layers)
            r = {"hidden": hidden}
            for which in ("tpkit", "hf"):
                try:
                    r[which] = tpkit.launch(_tp_body, 2, backend="gloo", args=(path, a.tokens, a.repeats, which),
                                            timeout=1200)[0]
                except Exception as exc:  # noqa: BLE001 - reported in the table
                    print(f"{which} TP2 failed at hidden {hidden}: {type(exc).__name__}: {exc}"[:400])
                    r[which] = float("nan")
            model = _load(path)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                r[f"single{threads}"] = ms_per_token(model, a.tokens, a.repeats)
            del model
            rows.append(r)
            print(r, flush=True)
    print(f"\n{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {datetime.date.today()}; "
          f"Llama {a.layers} layers fp32, greedy, ms/token (median of {a.repeats})")
    print("| hidden | tpkit TP2 | transformers TP2 | 1 proc 1 thread | 1 proc 2 threads | tpkit / transformers "
          "| 1 thread / tpkit TP2 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['hidden']} | {r['tpkit']:.2f} | {r['hf']:.2f} | {r['single1']:.2f} | {r['single2']:.2f} | "
              f"{r['tpkit'] / r['hf']:.2f} | {r['single1'] / r['tpkit']:.2f}x |")


if __name__ == "__main__":
    main()
