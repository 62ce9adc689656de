"""`from_pretrained` plans what `parallelize` plans (issue 55 item 3): for every causal-LM class of the zoo sweep that
converts exactly there (`bench/results/zoo_sweep.csv`), its shrunk config with `pad_token_id`, `bos_token_id` and
`eos_token_id` set (0, 1, 2: published checkpoints commonly set them), saved as a checkpoint; at 2 and 3 thread-ranks
the plan `tpkit.from_pretrained` makes of that directory (parameters on the meta device) against the plan
`tpkit.parallelize` makes of the same model built in memory: the same style for every module, and the same share of
the parameters on every rank.

A GPT-2 with `pad_token_id` once split nothing through `from_pretrained` (its forward read the token ids' values,
which meta ids do not have: the trace now tries real ids next).

`--cached`: instead, the plan cache (`checkpoint/plan_cache.py`, on in a temporary directory) against no cache: each
rank loads the directory twice, the first load deciding and storing the plan, the second applying it as recorded
(no trace, no dry run), and the two must be the same model: the same style for every module, every parameter and
buffer equal, and equal logits on the class's inputs.

    PYTHONPATH=src python bench/pretrained_plans.py [--only REGEX] [--worlds 2,3] [--cached]
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent / "src"), str(BENCH)]

SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _with_special_tokens(config):
    for c in [config] + [getattr(config, k) for k in vars(config) if k.endswith("config")]:
        for k, v in SPECIAL.items():
            if hasattr(c, k) or k == "pad_token_id":
                try:
                    setattr(c, k, v)
                except Exception:  # noqa: BLE001 - a config that refuses the attribute keeps its own
                    pass
    return config


def _share(model) -> float:
    """The rank's parameters over the whole model's (what its record says the full tensors are)."""
    from tpkit.nn.full_tensors import full_numel
    from tpkit.nn.record import find_record

    record = find_record(model, "share")[1]
    local = sum(p.numel() for p in model.parameters())
    return local / sum(full_numel(record, k, p) for k, p in model.named_parameters())


def compare(model_type: str, cls_name: str, worlds: list[int]) -> str:
    """"same", or what differs."""
    import transformers

    import sweep_build
    import tpkit

    cls = getattr(transformers, cls_name)
    config = _with_special_tokens(sweep_build.config_for(model_type))
    torch.manual_seed(1234)
    model = cls(config).eval()
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        for world in worlds:
            copies = [copy.deepcopy(model) for _ in range(world)]

            def rank(comm, copies=copies):
                loaded = tpkit.from_pretrained(d, comm=comm, model_cls=cls, dtype=torch.float32, progress=False)
                built = tpkit.parallelize(copies[comm.rank], comm=comm)
                return (loaded.tp_plan.entries, _share(loaded)), (built.tp_plan.entries, _share(built))

            for r, ((got, s1), (want, s2)) in enumerate(tpkit.launch(rank, world, backend="threads",
                                                                       pass_comm=True)):
                if got != want:
                    diff = {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
                    return f"at {world} ranks: styles differ ({len(diff)}: {dict(list(diff.items())[:2])})"
                if abs(s1 - s2) > 1e-9:
                    return f"at {world} ranks, rank {r}: share {s1:.4f} vs {s2:.4f}"
    return "same"


def compare_cached(model_type: str, cls_name: str, worlds: list[int]) -> str:
    """"same", or how the load from the plan cache differs from the load that decided the plan."""
    import transformers

    import sweep_build
    import tpkit
    from tpkit.checkpoint import plan_cache

    cls = getattr(transformers, cls_name)
    config = _with_special_tokens(sweep_build.config_for(model_type))
    torch.manual_seed(1234)
    model = cls(config).eval()
    x = sweep_build.inputs(model, "causal")
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        for world in worlds:
            def rank(comm):
                fresh = tpkit.from_pretrained(d, comm=comm, model_cls=cls, dtype=torch.float32, progress=False)
                hit = plan_cache.read(plan_cache.key(*_key_args(d, cls, comm.world_size)), comm.world_size,
                                      "inference") is not None
                cached = tpkit.from_pretrained(d, comm=comm, model_cls=cls, dtype=torch.float32, progress=False)
                with torch.no_grad():
                    out = [m(**x).logits for m in (fresh, cached)]
                state = [dict(m.state_dict()) for m in (fresh, cached)]
                same_state = state[0].keys() == state[1].keys() and all(torch.equal(v, state[1][k])
                                                                      for k, v in state[0].items())
                return hit, fresh.tp_plan.entries == cached.tp_plan.entries, same_state, torch.equal(*out)

            for r, (hit, plan, state, out) in enumerate(tpkit.launch(rank, world, backend="threads",
                                                                       pass_comm=True)):
                if not hit:
                    return f"at {world} ranks: no plan stored"
                if not (plan and state and out):
                    return f"at {world} ranks, rank {r}: plan {plan}, state {state}, logits {out}"
    return "same"


def _key_args(directory: str, cls, world: int) -> tuple:
    """`plan_cache.key`'s arguments as `from_pretrained` computes them for `directory` at float32."""
    from tpkit.checkpoint.load import open_source
    from tpkit.checkpoint.pretrained import build, load_config

    source = open_source(directory, 0, world)
    config = load_config(source, directory)
    return build(config, cls, torch.float32), config, source, torch.float32, {}, world, "inference", None


def main() -> None:
    import sweep_report

    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None)
    ap.add_argument("--worlds", default="2,3")
    ap.add_argument("--cached", action="store_true", help="the plan cache's load against the one that decided")
    args = ap.parse_args()
    if args.cached:
        import os

        os.environ["TPKIT_PLAN_CACHE"] = "1"
        os.environ["TPKIT_CACHE"] = tempfile.mkdtemp(prefix="tpkit-plan-cache-")
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = [r for r in sweep_report.read(sweep_report.CSV) if r["task"] == "causal" and r["outcome"] == "exact"
            and (not args.only or re.search(args.only, r["cls"]))]
    counts: dict[str, int] = {}
    start = time.perf_counter()
    for i, row in enumerate(rows):
        t = time.perf_counter()
        try:
            outcome = (compare_cached if args.cached else compare)(row["model_type"], row["cls"], worlds)
        except Exception as exc:  # noqa: BLE001 - a model that cannot be saved or loaded is reported as such
            outcome = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        kind = outcome.split(":")[0] if outcome != "same" else "same"
        counts[kind] = counts.get(kind, 0) + 1
        print(f"[{i + 1}/{len(rows)} {time.perf_counter() - start:5.0f}s] {row['cls']}: {outcome} "
              f"({time.perf_counter() - t:.1f}s)", flush=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}: {len(rows)} causal-LM classes, pad/bos/eos set, worlds {worlds}"
          + (", cached against decided" if args.cached else "") + ": "
          + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
