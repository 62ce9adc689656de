"""`model`'s trip through `parallelize`: how many tpkit functions it stops in, in how many modules, and how often
the trip returns to a module it had already left (the house issue's measure of how tangled conversion is).

A stop is a call of a function defined under src/tpkit that receives the model object as an argument, itself or
in a record that carries it (`.model`, as the trace's analysis does);
its module is the file the function is defined in. A return is a stop in a module seen before, other than the
one the previous stop was in. Measured on a tiny Llama converted at 2 thread-ranks (rank 0's trip). The grouped
view counts the same trip by concern (the trace, the architecture families, each step), which is what tangling
between steps looks like.

Run: `PYTHONPATH=src python bench/convert_trip.py [--show]`.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path


def tiny_llama():
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).eval()


def _carries(value, model, records: bool) -> bool:
    """The model itself, or (with `records`) a record holding it (the trace's analysis carries `.model`)."""
    return value is model or (records and getattr(value, "model", None) is model)


def trip(model, world_size: int = 2, records: bool = True) -> list[tuple[str, str]]:
    """(module, function) of every stop on rank 0, in call order."""
    import tpkit

    src = str(Path(tpkit.__file__).resolve().parent)
    copies = [copy.deepcopy(model) for _ in range(world_size)]
    stops: list[tuple[str, str]] = []

    def run(comm):
        m = copies[comm.rank]

        def profile(frame, event, arg):
            if event != "call" or comm.rank != 0 or not frame.f_code.co_filename.startswith(src):
                return
            args = frame.f_code.co_varnames[:frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount]
            if any(_carries(frame.f_locals.get(a), m, records) for a in args):
                where = Path(frame.f_code.co_filename).resolve().relative_to(src).with_suffix("")
                stops.append((".".join(where.parts), frame.f_code.co_name))

        sys.setprofile(profile)
        try:
            tpkit.parallelize(m, comm=comm)
        finally:
            sys.setprofile(None)

    tpkit.run_threads(run, world_size)
    return stops


# Today's concerns, for the grouped view (a module of the tree before the house issue maps to its concern too).
CONCERNS = {"trace": ("convert.trace", "convert.structure", "convert.pairs"),
            "families": ("convert.family", "convert.families", "convert.fastpath", "convert.experts",
                         "convert.expert_blocks", "convert.mha", "convert.per_head", "convert.sequence",
                         "convert.losses", "convert.heads")}


def concern(module: str) -> str:
    """The step or concern a module belongs to: trace, families, or the module itself (a step)."""
    return next((c for c, prefixes in CONCERNS.items() if any(module == p or module.startswith(p + ".")
                                                             for p in prefixes)), module)


def summarise(stops: list[tuple[str, str]]) -> dict:
    seen, returns, previous = set(), 0, None
    for module, _ in stops:
        if module != previous and module in seen:
            returns += 1
        seen.add(module)
        previous = module
    return {"stops": len(stops), "modules": len(seen), "returns": returns}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--show", action="store_true", help="print every stop")
    args = parser.parse_args()
    for records in (False, True):
        stops = trip(tiny_llama(), records=records)
        if args.show:
            for module, func in stops:
                print(f"{module}.{func}")
        what = "model or records carrying it" if records else "the model object itself"
        print(what, summarise(stops), "by concern:", summarise([(concern(m), f) for m, f in stops]))


if __name__ == "__main__":
    main()
