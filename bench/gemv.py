"""tpkit's compiled small-batch product alone (`src/tpkit/quant/gemv.c`), this tree's against an earlier commit's:
the stored bytes per second of one [4096 x 2048] layer at 1, 4 and 8 activation rows (bf16), its weights rotated
through 24 copies so every call reads them from memory, as a model's layers do; `sum()` over the same bytes for
the streaming rate. Kinds: int4 group 128 (bf16 scales, offset 8), int8 per channel (packed uint8, offset 128),
bf16. The two builds alternate in the same process, median of `--repeats` rounds each.

    PYTHONPATH=src python bench/gemv.py [--against 253347a] [--repeats 5]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time

import torch

from tpkit.quant import native

N, K, COPIES = 4096, 2048, 24


def _built(source: str, out: str):
    """The `tp_gemv` of `source` compiled as `native.build` compiles this tree's."""
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", source, "-o", out], check=True)
    fn = ctypes.CDLL(out).tp_gemv
    fn.argtypes, fn.restype = native._function().argtypes, None
    return fn


def _cases(g: torch.Generator) -> dict:
    """kind -> (weights, scale, block, offset)."""
    return {"int4": ([torch.randint(0, 255, (N, K // 2), dtype=torch.uint8, generator=g) for _ in range(COPIES)],
                     (torch.rand(N, K // 128, generator=g) * 0.01).to(torch.bfloat16), (1, 128), 8),
            "int8": ([torch.randint(0, 255, (N, K), dtype=torch.uint8, generator=g) for _ in range(COPIES)],
                     (torch.rand(N, 1, generator=g) * 0.01).to(torch.bfloat16), (1, K), 128),
            "bf16": ([torch.randn(N, K, generator=g).to(torch.bfloat16) for _ in range(COPIES)], None, (1, 1), 0)}


def _rate(fn, kind: str, case, rows: int) -> float:
    """Stored bytes per second of one pass over the copies with `fn` as the product."""
    ws, scale, block, offset = case
    code = {"int4": "uint4", "int8": "uint8", "bf16": "bf16"}[kind]
    x = torch.randn(rows, K).to(torch.bfloat16)
    native._LIB[:] = [fn]
    for w in ws[:2]:
        native.gemv(x, w, code, N, scale, None, block, offset)
    start = time.perf_counter()
    for w in ws:
        native.gemv(x, w, code, N, scale, None, block, offset)
    seconds = (time.perf_counter() - start) / len(ws)
    return (ws[0].nbytes + (scale.nbytes if scale is not None else 0)) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", default="253347a", help="the earlier commit whose gemv.c is built beside this one")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not native.available():
        raise SystemExit("no C compiler built tpkit's product here")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        old_c = os.path.join(tmp, "old.c")
        with open(old_c, "w") as f:
            f.write(subprocess.run(["git", "-C", root, "show", f"{args.against}:src/tpkit/quant/gemv.c"],
                                   check=True, capture_output=True, text=True).stdout)
        builds = {args.against: _built(old_c, os.path.join(tmp, "old.so")),
                  "this tree": _built(os.path.join(root, "src/tpkit/quant/gemv.c"), os.path.join(tmp, "new.so"))}
        cases = _cases(torch.Generator().manual_seed(0))
        flat = [t.view(-1).float() for t in cases["int8"][0][:8]]
        start = time.perf_counter()
        for t in flat:
            t.sum()
        stream = sum(t.nbytes for t in flat) / (time.perf_counter() - start)
        rates = {(b, k, m): [] for b in builds for k in cases for m in (1, 4, 8)}
        for _ in range(args.repeats):
            for (b, k, m) in rates:
                rates[b, k, m].append(_rate(builds[b], k, cases[k], m))
    print(f"| kind | rows | {args.against} GB/s | this tree GB/s | ratio |\n|---|---|---|---|---|")
    for k in cases:
        for m in (1, 4, 8):
            old, new = (statistics.median(rates[b, k, m]) / 1e9 for b in builds)
            print(f"| {k} | {m} | {old:.1f} | {new:.1f} | {new / old:.2f}x |")
    print(f"\n`sum()` over float32 copies: {stream / 1e9:.1f} GB/s; [{N} x {K}], {COPIES} copies, bf16 activations, "
          f"1 thread, median of {args.repeats} alternating rounds")


if __name__ == "__main__":
    main()
