"""The zoo sweep (issue 24): every transformers class for causal LM, masked LM, seq2seq LM, sequence and image
classification, shrunk generically (`sweep_build.py`), converted with plan="auto" at 2 and 3 thread-ranks in
float64 and compared with the unconverted model (`sweep_run.py`); one CSV row per class
(`bench/results/zoo_sweep.csv`, appended per model: a second run skips what is there).

Each model runs in a worker subprocess under a time limit (`--limit`, seconds); a worker past it is killed, the
model is recorded as skipped, and a fresh worker goes on with the rest. `--report` prints the summary and writes
the share plot; `--page` also rewrites the block on the site's coverage page (docs/reference/coverage.md). `--only PATTERN` runs the classes whose name matches.

Run: `python bench/zoo_sweep.py` (then `--report --page`); `--fresh` starts the CSV over.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH.parent / "src"), str(BENCH)]

import sweep_report  # noqa: E402


def worker(keys: list[list[str]]) -> None:
    """Run each `(task, model_type, cls)` in turn; print `BEGIN` before and `ROW <json>` after each."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from sweep_run import run_one

    for task, model_type, cls in keys:
        print("BEGIN", json.dumps([task, model_type, cls]), flush=True)
        print("ROW", json.dumps(run_one(task, model_type, cls)), flush=True)


def _spawn(keys: list) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BENCH.parent / "src"), str(BENCH.parent)]),
               TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1)
    proc.stdin.write(json.dumps(keys))
    proc.stdin.close()
    return proc


def sweep(todo: list, limit: float, csv_path: Path) -> None:
    """Run `todo` through workers, one model at a time, killing a worker that overruns `limit` on one model."""
    done, total, start = 0, len(todo), time.perf_counter()
    while todo:
        proc, current, since = _spawn(todo), None, time.perf_counter()
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if not ready:
                if current is not None and time.perf_counter() - since > limit:
                    proc.kill()
                    proc.wait()
                    sweep_report.append({"task": current[0], "model_type": current[1], "cls": current[2],
                                         "outcome": "skipped", "detail": f"over the {limit:.0f} s limit",
                                         "seconds": f"{limit:.0f}"}, csv_path)
                    todo = todo[todo.index(current) + 1:]
                    done += 1
                    break
                continue
            line = proc.stdout.readline()
            if not line:  # the worker died (memory, a hard crash): record it and go on after it
                proc.wait()
                if current is not None:
                    sweep_report.append({"task": current[0], "model_type": current[1], "cls": current[2],
                                         "outcome": "crashed", "detail": f"worker died (exit {proc.returncode})"},
                                        csv_path)
                    todo = todo[todo.index(current) + 1:]
                    done += 1
                else:
                    todo = []
                break
            if line.startswith("BEGIN "):
                current, since = json.loads(line[6:]), time.perf_counter()
            elif line.startswith("ROW "):
                row = json.loads(line[4:])
                sweep_report.append(row, csv_path)
                todo = todo[todo.index(current) + 1:]
                done, current = done + 1, None
                elapsed = time.perf_counter() - start
                print(f"[{done}/{total} {elapsed:5.0f}s] {row['cls']}: {row['outcome']} share2={row['share2']} "
                      f"{row['seconds']}s {row['detail'][:90]}", flush=True)


def report(rows: list, page: bool) -> None:
    print(sweep_report.table(rows))
    print("\nMost common reasons for keeping something whole (architectures naming it):")
    for reason, n in sweep_report.reasons(rows):
        print(f"  {n:4d}  {reason}")
    print(f"plot: {sweep_report.plot(rows)}")
    if page:
        sweep_report.write_page(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--report", action="store_true", help="summary and plot from the CSV; no models run")
    ap.add_argument("--page", "--readme", dest="page", action="store_true",
                    help="with --report: rewrite the block on docs/reference/coverage.md")
    ap.add_argument("--only", default=None, help="regex on the class name")
    ap.add_argument("--limit", type=float, default=90.0, help="seconds per model")
    ap.add_argument("--csv", type=Path, default=sweep_report.CSV)
    ap.add_argument("--fresh", action="store_true", help="start the CSV over")
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(sys.stdin.read()))
        return 0
    if args.report:
        report(sweep_report.read(args.csv), args.page)
        return 0
    if args.fresh and args.csv.exists():
        args.csv.unlink()
    from sweep_build import classes

    have = {sweep_report.key(r) for r in sweep_report.read(args.csv)}
    todo = [list(k) for k in classes() if k not in have and (not args.only or re.search(args.only, k[2]))]
    print(f"{len(todo)} classes to run ({len(have)} already in {args.csv})", flush=True)
    sweep(todo, args.limit, args.csv)
    report(sweep_report.read(args.csv), False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
