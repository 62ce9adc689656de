"""Checkpoint loading benchmark: tpkit.from_pretrained vs transformers' tp_plan="auto" at TP 2 on gloo.

A ~0.7 GB fp32 Llama (hidden 1024, 8 layers, vocab 32000) is written once as a Hugging Face directory. Each
trial is a fresh `tpkit.launch` of 2 gloo processes (the launcher sets RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT as torchrun does, which transformers' tp_plan reads). In each rank a background thread samples
/proc/self/statm RSS every 2 ms during the call; we report the peak above the RSS just before the call
(VmHWM cannot be reset; imports both loaders need are done before), as a fraction of the checkpoint size, and the wall time. Loaders alternate; medians
over --reps. Also: reloading a tpkit checkpoint (save_sharded at the same TP) vs the HF directory.

    PYTHONPATH=src python bench/checkpoint.py [--reps 3] [--dir /tmp/tpkit-bench-ckpt]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")


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


def make_checkpoint(path: str) -> None:
    import transformers as tr

    if os.path.exists(os.path.join(path, "config.json")):
        return
    cfg = tr.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    tr.LlamaForCausalLM(cfg).save_pretrained(path)


def rank_body(kind: str, path: str) -> dict:
    import tpkit

    import torch.distributed.tensor  # noqa: F401  (imports both loaders need, paid before the clock starts)
    import transformers as tr
    import transformers.models.llama.modeling_llama  # noqa: F401
    from tpkit.checkpoint import pretrained  # noqa: F401

    comm = tpkit.get_communicator()
    comm.barrier()
    with PeakRSS() as m:
        t0 = time.perf_counter()
        if kind == "transformers":
            import transformers as tr

            model = tr.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
        else:
            model = tpkit.from_pretrained(path, comm=comm, progress=False)
        touch(model)
        wall = time.perf_counter() - t0
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    return {"peak": m.peak - m.base, "wall": wall, "local_param_bytes": local}


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


def main() -> int:
    import tpkit

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/tpkit-bench-ckpt")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--kinds", default="tpkit,transformers,tpkit-ckpt")
    args = ap.parse_args()
    hf, ck = os.path.join(args.dir, "hf"), os.path.join(args.dir, "tpkit")
    make_checkpoint(hf)
    if not os.path.exists(os.path.join(ck, "latest")):
        tpkit.launch(save_tpkit, args.tp, backend="gloo", args=(hf, ck), timeout=600)
    size = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf) if f.endswith(".safetensors"))
    from safetensors import safe_open

    with safe_open(os.path.join(hf, "model.safetensors"), "pt") as f:
        largest = max(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[-1] for k in f.keys()) * 4
    kinds = args.kinds.split(",")
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for rep in range(args.reps):
        for kind in (kinds if rep % 2 == 0 else kinds[::-1]):
            path = ck if kind == "tpkit-ckpt" else hf
            res = tpkit.launch(rank_body, args.tp, backend="gloo", args=("transformers" if kind == "transformers"
                                                                         else "tpkit", path), timeout=600)
            runs[kind].append({"peak": max(r["peak"] for r in res), "wall": max(r["wall"] for r in res)})
            print(kind, rep, runs[kind][-1], file=sys.stderr, flush=True)
    out = {"checkpoint_bytes": size, "largest_tensor_fraction": largest / size, "tp": args.tp,
           "target_peak_fraction": 1 / args.tp + largest / size + 0.15}
    for kind, rs in runs.items():
        out[kind] = {"peak_fraction": statistics.median(r["peak"] for r in rs) / size,
                     "wall_s": statistics.median(r["wall"] for r in rs)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
