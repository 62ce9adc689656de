"""The trace's one forward (`run_once`) and what it leaves behind in a model's modules besides parameters and
buffers, saved before that forward and put back after it, so tracing a model changes nothing in it."""
from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
from torch import nn


def module_state(model: nn.Module) -> list:
    """What a forward may leave behind in its modules besides parameters and buffers: caches (Levit's
    `attention_bias_cache`, filled in eval mode) and tensors set as attributes. The trace runs under no_grad on
    the whole weights; a cache it filled would be stale after the split and cut the gradient."""
    out = []
    for m in model.modules():
        values = {k: v for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, (dict, list))}
        out.append((m, set(vars(m)), {k: (v, copy.copy(v)) for k, v in values.items()},
                    {k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor)}))
    return out


def restore(state: list) -> None:
    for m, names, containers, tensors in state:
        for k in set(vars(m)) - names:
            if isinstance(vars(m)[k], (torch.Tensor, dict, list)):
                delattr(m, k)
        for k, (obj, saved) in containers.items():
            if isinstance(obj, dict):
                obj.clear()
                obj.update(saved)
            else:
                obj[:] = saved
            vars(m)[k] = obj
        for k, t in tensors.items():
            vars(m)[k] = t


def run_once(model: nn.Module, example_inputs: Any, mode: Any) -> Any:
    """One forward under `mode` (the tracer's TorchFunctionMode), in eval mode (no dropout draws from the RNG and
    no BatchNorm statistics move; the dataflow is the same), restoring each module's training flag after."""
    was_training = {m: m.training for m in model.modules()}
    state = module_state(model)
    model.eval()
    try:
        with torch.no_grad(), mode:
            if isinstance(example_inputs, Mapping):
                return model(**example_inputs)
            if isinstance(example_inputs, torch.Tensor):  # one input, as verify() calls it; not its rows
                return model(example_inputs)
            return model(*example_inputs)
    finally:
        for m, flag in was_training.items():
            m.training = flag
        restore(state)


def output_tensors(out: Any):
    """Every tensor of a model's output (tensors, mappings, sequences, ModelOutput)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, Mapping):
        for v in out.values():
            yield from output_tensors(v)
    elif isinstance(out, (list, tuple)):
        for v in out:
            yield from output_tensors(v)
    elif hasattr(out, "to_tuple"):
        yield from output_tensors(out.to_tuple())
