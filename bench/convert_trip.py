"""`model`'s trip through `parallelize`: how many tpkit functions it stops in, in how many modules, and how often
the trip returns to a module it had already left (the house issue's measure of how tangled conversion is).

A stop is a call of a function defined under src/tpkit that receives the model object as an argument, itself or
in a record that carries it (`.model`, as the trace's analysis does; a generator resumed, as a `with` block's exit
resumes its context manager, is not a new call);
its module is the file the function is defined in. A return is a stop in a module seen before, other than the
one the previous stop was in. Measured at 2 thread-ranks (rank 0's trip) on four ways in: a tiny Llama, the same
with PEFT LoRA adapters, an int8 checkpoint through `from_pretrained` (counted from the moment `parallelize`
receives the model it built to the moment it returns it: the load that follows is not the conversion), and "auto"
with overrides; each also reports how many times `parallelize` was entered (once: no recursion). The grouped view
counts the same trip by concern (the trace, the architecture families, each step), which is what tangling between
steps looks like.

Run: `PYTHONPATH=src python bench/convert_trip.py [--show] [--only NAME]`.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # tests.quant.checkpoints


def tiny_llama():
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).eval()


def lora_llama():
    import peft

    return peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))


def int8_checkpoint(directory: str) -> str:
    """A tiny Llama (hidden 128) written as a compressed-tensors int8 checkpoint by compressed-tensors itself."""
    import torch
    import transformers

    from tests.quant.checkpoints import compressed_tensors

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return compressed_tensors(transformers.LlamaForCausalLM(cfg).eval(), directory, "pack-quantized", num_bits=8,
                              type="int", symmetric=True, strategy="channel")


OVERRIDES = {"model.layers.*.mlp.*": "replicate", "lm_head": "replicate"}


def _carries(value, models: list, records: bool) -> bool:
    """One of the model objects itself, or (with `records`) a record holding one (the trace's analysis carries
    `.model`)."""
    return any(value is m or (records and getattr(value, "model", None) is m) for m in models)


def trip(convert, world_size: int = 2, records: bool = True) -> tuple[list[tuple[str, str]], int]:
    """(module, function) of every stop on rank 0, in call order, from the moment `parallelize` is entered with the
    model (`convert(comm)` converts one rank's model: a `parallelize` call, or a `from_pretrained` that builds the
    model and calls it); and how many times `parallelize` was entered on rank 0."""
    import tpkit
    try:
        from tpkit.convert.peft.adapters import peft_layers

        def bare(m):
            return peft_layers(m)[0]
    except ImportError:  # the tree before issue 55 (for its "before" figures)
        from tpkit.convert.peft.adapters import inner_model as bare

    src = str(Path(tpkit.__file__).resolve().parent)
    parallelize_code = importlib.import_module("tpkit.convert.parallelize").parallelize.__code__
    stops: list[tuple[str, str]] = []
    entered = [0]

    def run(comm):
        model, resumed, done = [], [], []

        def profile(frame, event, arg):
            if comm.rank != 0 or not frame.f_code.co_filename.startswith(src):
                return
            if event == "return" and model and frame.f_code is parallelize_code:
                done.append(True)  # the conversion's trip ends where `parallelize` returns (a load goes on)
            if event != "call" or done:
                return
            if frame.f_code.co_flags & inspect.CO_GENERATOR:  # a generator resumed (a `with` block's exit) is
                if any(f is frame for f in resumed):            # no new call
                    return
                resumed.append(frame)
            if frame.f_code.co_name == "parallelize" and frame.f_code.co_filename.endswith("parallelize.py"):
                entered[0] += 1
                if not model:  # the model given, and the bare model inside a PEFT model (the one converted)
                    model[:] = [frame.f_locals["model"], bare(frame.f_locals["model"])]
            if not model:
                return
            args = frame.f_code.co_varnames[:frame.f_code.co_argcount + frame.f_code.co_kwonlyargcount]
            if any(_carries(frame.f_locals.get(a), model, records) for a in args):
                where = Path(frame.f_code.co_filename).resolve().relative_to(src).with_suffix("")
                stops.append((".".join(where.parts), frame.f_code.co_name))

        sys.setprofile(profile)
        try:
            convert(comm)
        finally:
            sys.setprofile(None)

    tpkit.run_threads(run, world_size)
    return stops, entered[0]


def scenarios(directory: str) -> dict:
    """Name -> a function making a fresh `convert(comm)` for one trip (the models built once, copied per rank)."""
    import tpkit

    llama, lora = tiny_llama(), lora_llama()
    path = int8_checkpoint(f"{directory}/int8")

    def each_rank(model, plan="auto"):
        copies = [copy.deepcopy(model) for _ in range(2)]
        return lambda comm: tpkit.parallelize(copies[comm.rank], plan, comm=comm)

    return {"plain Llama": lambda: each_rank(llama),
            "PEFT-LoRA Llama": lambda: each_rank(lora),
            "int8 from_pretrained": lambda: lambda comm: tpkit.from_pretrained(path, comm=comm, progress=False),
            "auto + overrides": lambda: each_rank(llama, OVERRIDES)}


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
    parser.add_argument("--only", default="", help="run the scenarios whose name contains this")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        for name, fresh in scenarios(directory).items():
            if args.only not in name:
                continue
            for records in (False, True):
                stops, entered = trip(fresh(), records=records)
                if args.show:
                    for module, func in stops:
                        print(f"{module}.{func}")
                what = "model or records carrying it" if records else "the model object itself"
                print(f"{name}: {what} {summarise(stops)}, parallelize entered {entered}x; by concern:",
                      summarise([(concern(m), f) for m, f in stops]), flush=True)


if __name__ == "__main__":
    main()
