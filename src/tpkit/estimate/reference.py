"""The per-op fixed cost as a real model pays it, measured on a small reference model.

An op's fixed cost is not that of a bare `x + 1` in a loop (~5 us here): a model's forward runs Python around
each op (modules, hooks, the framework's own glue), and a training step's backward and optimizer ops pay less of
it. So the cost is read off a model: a reference Llama small enough that its kernels cost next to nothing is
timed for real (a decode step, a prefill, a training step), its step is traced with the same op recorder the
predictions use (`fake_step.trace_step`), and the time its kernels would take at the measured rates is subtracted;
what is left, divided by the ops counted, is the fixed cost per op. `--model` measures the user's own model
shrunk the same way instead.
"""
from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
from torch import nn

from .calls import meta_copy
from .machine import MachineRates
from .fake_step import trace_step
from .predict import kernel_seconds


def reference_model(config=None) -> nn.Module:
    """A tiny float32 model of `config`'s architecture (default: a Llama), weights from a fixed seed."""
    import transformers as tr

    if config is None:
        config = tr.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    model = tr.AutoModelForCausalLM.from_config(config)
    return model.float().eval()


def _time_decode(model: nn.Module, context: int, repeats: int) -> float:
    ids = torch.randint(3, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        token = ids[:, :1]
        times = []
        for _ in range(repeats + 2):
            start = time.perf_counter()
            model(input_ids=token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            cache.crop(-1)  # back to the context: every step decodes the same position
    return statistics.median(times[2:])


def _time_train(model: nn.Module, seq: int, repeats: int) -> float:
    """Median seconds of a training step (forward, backward, AdamW) on `model` itself: a converted model holds a
    communicator and is not deep-copied; callers pass a copy of a plain one."""
    model.train()
    ids = torch.randint(3, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def op_overheads(rates: MachineRates, model: nn.Module | None = None,
                 repeats: int = 7) -> tuple[float, float, int]:
    """(seconds per op of a forward step, seconds per op of a training step, the most tensor bytes the training
    step holds) on this process, from `model` (default: the reference Llama): measured time less kernel time, over
    the traced op count; the bytes are the trace's (`StepTrace.peak_bytes`) plus the model's own copy, so what the
    process holds beyond them is the runtime's."""
    model = model or reference_model()
    context = 32
    meta = meta_copy(model)
    decode = trace_step(meta, "decode", 1, 0, batch=1, seq=context)
    train = trace_step(meta, "train", 1, 0, batch=1, seq=context)
    measured = {"decode": _time_decode(model, context, repeats),
                "train": _time_train(copy.deepcopy(model), context, repeats)}
    out = []
    for goal, trace in (("decode", decode), ("train", train)):
        left = measured[goal] - kernel_seconds(trace, rates)
        out.append(max(left, 0.0) / max(len(trace.ops), 1))
    return out[0], out[1], train.peak_bytes + train.parameter_bytes


def collective_overheads(rates: MachineRates, comm, model: nn.Module | None = None,
                         repeats: int = 7) -> tuple[float, float]:
    """(seconds per tensor-parallel collective in a forward step, in a training step) beyond the isolated call:
    the reference model converted over `comm` (call on every rank) is timed, and what its step's ops (at
    `rates.op_overhead_s`), kernels and collectives (at `rates.collectives`, measured alone) do not explain,
    divided by its collectives, is what each one costs in a step: the parallel layers' Python around it and the
    wait for the slower rank."""
    from ..convert.parallelize import parallelize

    model = model or reference_model()
    context, meta = 32, meta_copy(model)
    out = []
    for goal, mode in (("decode", "inference"), ("train", "training")):
        trace = trace_step(meta, goal, comm.world_size, comm.rank, batch=1, seq=context)
        converted = parallelize(copy.deepcopy(model), "auto", comm, mode=mode)
        comm.barrier()
        if goal == "decode":
            measured, per_op = _time_decode(converted, context, repeats), rates.op_overhead_s
        else:
            measured, per_op = _time_train(converted, context, repeats), rates.train_op_overhead_s
        alone = sum(rates.collective(c.kind, c.world_size).seconds(c.nbytes) for c in trace.collectives)
        left = measured - kernel_seconds(trace, rates) - len(trace.ops) * per_op - alone
        out.append(max(left, 0.0) / max(len(trace.collectives), 1))
    return out[0], out[1]


def describe(model: nn.Module | None) -> dict[str, Any]:
    """What the overheads were measured on, for the profile's sources."""
    m = model or reference_model()
    cfg = getattr(m, "config", None)
    return {"model": type(m).__name__, "hidden": getattr(cfg, "hidden_size", None),
            "layers": getattr(cfg, "num_hidden_layers", None)}
