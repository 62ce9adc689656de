"""Checkpoint loading benchmark: tpkit.from_pretrained vs transformers' tp_plan="auto" at TP 2 on gloo.

A ~0.64 GB fp32 Llama (hidden 1024, 8 layers, vocab 32000) is written once as a Hugging Face directory, and once
as a tpkit checkpoint saved at the same TP. Each trial is a fresh Python process (this script with --trial) that
starts a fresh `tpkit.launch` of 2 gloo processes (the launcher sets RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT as torchrun does, which transformers' tp_plan reads). In each rank a background thread samples
/proc/self/statm RSS every 2 ms during the call; we report the peak above the RSS just before the call (VmHWM
cannot be reset), as a fraction of the checkpoint size, the wall time, and for tpkit the read phase alone (the
time inside `read_targets`, after the model is built and planned). The clock stops once every weight the rank
holds has been read once (`touch`: a lazily mapped loader pays its reads there). Kinds alternate (the order
reversed every other rep); medians over --reps; each figure is the slower rank's.

Kinds: `tpkit` (HF directory), `transformers`, `tpkit-ckpt` (the tpkit checkpoint), `tpkit-nocache` (the HF
directory with `TPKIT_PLAN_CACHE=0`: the plan decided by every load, as before the plan cache; `tpkit` uses the
cache, whose first trial may decide and store the plan), and their `-cold` variants: the first load in a fresh process, with nothing but torch and tpkit imported before (the imports
the loader needs are in the figure; peak is not comparable there). `--before REF` adds `tpkit@before` and
`tpkit-ckpt@before`: the same trials run on `git archive REF src` (the code before a change), alternating with
the current code in the same run.

    PYTHONPATH=src python bench/checkpoint.py [--reps 9] [--before HEAD~3] [--kinds tpkit,transformers] [--size large]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")
HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    def __enter__(self):
        self.base, self.peak, self._stop = rss(), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


# --size: the Llama's (hidden, intermediate, layers): ~0.64 GB and ~3.5 GB in float32
SIZES = {"small": (1024, 2816, 8), "large": (2048, 5632, 16)}


def make_checkpoint(path: str, size: str = "small") -> None:
    import transformers as tr

    if os.path.exists(os.path.join(path, "config.json")):
        return
    hidden, inter, layers = SIZES[size]
    cfg = tr.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    tr.LlamaForCausalLM(cfg).save_pretrained(path)


def rank_body(loader: str, path: str, cold: bool) -> dict:
    import tpkit
    from tpkit.checkpoint import pretrained

    if not cold:  # imports both loaders need, paid before the clock starts
        import torch.distributed.tensor  # noqa: F401
        import transformers  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401
    read = []
    real = pretrained.read_targets

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            read.append(time.perf_counter() - t)

    pretrained.read_targets = timed
    comm = tpkit.get_communicator()
    comm.barrier()
    with PeakRSS() as m:
        t0 = time.perf_counter()
        if loader == "transformers":
            import transformers as tr

            model = tr.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
        else:
            model = tpkit.from_pretrained(path, comm=comm, progress=False)
        touch(model)
        wall = time.perf_counter() - t0
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    return {"peak": m.peak - m.base, "wall": wall, "read": sum(read) if read else None, "local_param_bytes": local}


def touch(model) -> None:
    """Read every byte of every local weight once (a lazily mapped loader pays its reads here), as the
    measure requires: peak and wall run until each weight this rank holds has been read."""
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.sum()


def save_tpkit(path: str, out: str) -> None:
    import tpkit

    tpkit.save_sharded(tpkit.from_pretrained(path, progress=False), out, progress=False)


def trial(kind: str, path: str, tp: int) -> dict:
    """One trial, in this (fresh) process: `kind` without its @ suffix, on the tpkit this process imports."""
    import tpkit

    base = kind.split("@")[0].replace("-nocache", "")
    cold = base.endswith("-cold")
    loader = "transformers" if base.startswith("transformers") else "tpkit"
    res = tpkit.launch(rank_body, tp, backend="gloo", args=(loader, path, cold), timeout=600)
    out = {"peak": max(r["peak"] for r in res), "wall": max(r["wall"] for r in res)}
    if res[0]["read"] is not None:
        out["read"] = max(r["read"] for r in res)
    return out


def run_trial(kind: str, path: str, tp: int, src: str) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    if "nocache" in kind:
        env["TPKIT_PLAN_CACHE"] = "0"
    cmd = [sys.executable, os.path.abspath(__file__), "--trial", kind, "--path", path, "--tp", str(tp)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"trial {kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoints are written once (default by --size)")
    ap.add_argument("--size", choices=sorted(SIZES), default="small", help="small ~0.64 GB, large ~3.5 GB (float32)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--kinds", default="tpkit,transformers,tpkit-ckpt")
    ap.add_argument("--before", default=None, help="git ref: also run tpkit kinds on that ref's src, alternating")
    ap.add_argument("--trial", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args()
    if args.trial:
        print(json.dumps(trial(args.trial, args.path, args.tp)))
        return 0
    import tpkit

    args.dir = args.dir or ("/tmp/tpkit-bench-ckpt" if args.size == "small" else f"/tmp/tpkit-bench-ckpt-{args.size}")
    hf, ck = os.path.join(args.dir, "hf"), os.path.join(args.dir, "tpkit")
    make_checkpoint(hf, args.size)
    kinds = args.kinds.split(",")
    if any(k.startswith("tpkit-ckpt") for k in kinds) and not os.path.exists(os.path.join(ck, "latest")):
        tpkit.launch(save_tpkit, args.tp, backend="gloo", args=(hf, ck), timeout=600)
    files = [os.path.join(hf, f) for f in os.listdir(hf) if f.endswith(".safetensors")]
    size = sum(os.path.getsize(f) for f in files)
    from safetensors import safe_open

    largest = 0
    for name in files:
        with safe_open(name, "pt") as f:
            largest = max([largest] + [f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[-1] * 4
                                       for k in f.keys()])
    srcs = {k: SRC for k in kinds}
    tmp = None
    if args.before:
        tmp = tempfile.TemporaryDirectory(prefix="tpkit-before-")
        archive = subprocess.run(["git", "-C", os.path.dirname(HERE), "archive", args.before, "src"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp.name], input=archive, check=True)
        for k in [k for k in kinds if k.startswith("tpkit")]:
            kinds.append(f"{k}@before")
            srcs[f"{k}@before"] = os.path.join(tmp.name, "src")
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for rep in range(args.reps):
        for kind in (kinds if rep % 2 == 0 else kinds[::-1]):
            path = ck if kind.split("@")[0].startswith("tpkit-ckpt") else hf
            runs[kind].append(run_trial(kind, path, args.tp, srcs[kind]))
            print(kind, rep, {k: round(v, 3) for k, v in runs[kind][-1].items()}, file=sys.stderr, flush=True)
    out = {"checkpoint_bytes": size, "largest_tensor_fraction": largest / size, "tp": args.tp, "reps": args.reps,
           "before": args.before, "target_peak_fraction": 1 / args.tp + largest / size + 0.15}
    for kind, rs in runs.items():
        out[kind] = {"peak_fraction": statistics.median(r["peak"] for r in rs) / size,
                     "wall_s": statistics.median(r["wall"] for r in rs)}
        if all("read" in r for r in rs):
            out[kind]["read_s"] = statistics.median(r["read"] for r in rs)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
