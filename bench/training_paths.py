"""Worst gradient / updated-parameter error of one AdamW step through every entry path, per architecture and world
size, against one process of plain transformers + torch (tests/models/paths.py; issue 34's before / after table).

Float64, thread-ranks. Each line: architecture, world size, entry path, the worst relative gradient error and the
parameter where it occurs, the worst relative error of a parameter after the step, seconds. A path that fails
prints its error. Run it against another checkout's code to compare: `PYTHONPATH=<checkout>/src python ...`.

    python bench/training_paths.py [--archs llama,qwen3] [--worlds 2,3]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.models import paths as P  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", default=",".join(P.ARCHS))
    ap.add_argument("--worlds", default="2,3")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    for name in args.archs.split(","):
        with tempfile.TemporaryDirectory() as d:
            base, ref = P.prepare(name, d)
            for w in worlds:
                for path in P.PATHS:
                    t = time.perf_counter()
                    try:
                        res = P.run(base, ref, w, d, paths=(path,))
                    except Exception as exc:  # noqa: BLE001 - a failing path is a result too
                        print(f"{name:15s} tp{w} {path:25s} FAILED {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        continue
                    g = max(r[path]["grad"] for r in res)
                    p = max(r[path]["param"] for r in res)
                    print(f"{name:15s} tp{w} {path:25s} grad {g[0]:.1e} {g[1]:50s} param {p[0]:.1e} "
                          f"{time.perf_counter() - t:.1f}s", flush=True)


if __name__ == "__main__":
    main()
