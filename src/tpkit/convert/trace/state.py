"""The trace's one forward (`run_once`) and what it leaves behind in a model's modules besides parameters and
buffers, saved before that forward and put back after it, so tracing a model changes nothing in it.

A model whose parameters are on the meta device may hold real buffers beside them: `from_pretrained` builds it so
(`checkpoint/allocate.py`, `meta_parameters`: each module's `__init__` computes its buffers, the checkpoint fills
the parameters later). Its forward on meta inputs would fail where a real buffer meets a meta tensor (DeepSeek-V3's
router adds its `e_score_correction_bias` to meta scores), and a failed trace leaves the whole model unsplit. For
the trace's forward such a model's real tensors are seen as meta (`real_tensors_as_meta`), as in a model built
wholly on meta, and put back after.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterable, Mapping

import torch
from torch import nn


def module_state(modules: Iterable[nn.Module]) -> list:
    """What a forward may leave behind in a model's `modules` besides parameters and buffers: caches (Levit's
    `attention_bias_cache`, filled in eval mode) and tensors set as attributes. The trace runs under no_grad on
    the whole weights; a cache it filled would be stale after the split and cut the gradient."""
    out = []
    for m in modules:
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


@contextlib.contextmanager
def real_tensors_as_meta(modules: Iterable[nn.Module]):
    """Inside, a model (all its `modules`) with parameters on the meta device holds meta tensors (same shape, dtype
    and strides) in place of its real buffers and tensor attributes; after, even on error, it holds the very same
    tensor objects it held before (a forward that reassigned one is undone too). Tensors of no dimension stay: they
    combine with meta tensors as numbers do, and code may read their value. A model with no meta parameter is left
    as it is."""
    modules = list(modules)
    if not any(p is not None and p.is_meta for m in modules for p in m._parameters.values()):
        yield
        return
    memo: dict[int, torch.Tensor] = {}  # a tensor held in two places stays one tensor

    def meta(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = t.to("meta")
        return memo[id(t)]

    saved = [(m, dict(m._buffers), {k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor)})
             for m in modules]
    try:
        for m, buffers, tensors in saved:
            for k, b in buffers.items():
                if b is not None and not b.is_meta and b.dim():
                    m._buffers[k] = meta(b)
            for k, v in tensors.items():
                if not v.is_meta and v.dim() and not isinstance(v, nn.Parameter):
                    vars(m)[k] = meta(v)
        yield
    finally:
        for m, buffers, tensors in saved:
            m._buffers.clear()
            m._buffers.update(buffers)
            vars(m).update(tensors)


def popping(stack: list):
    """A forward hook that pops `stack` (pushed by the module's pre-hook) and leaves the output alone: a hook
    returning anything but None replaces the output, and `stack.pop() and None` returns the root module's name,
    "", which is not None. Register it with `always_call=True`: a forward that raises, caught by a parent, still
    pops."""
    def hook(*_):
        stack.pop()
    return hook


def run_once(model: nn.Module, example_inputs: Any, mode: Any) -> Any:
    """One forward under `mode` (the tracer's TorchFunctionMode), in eval mode (no dropout draws from the RNG and
    no BatchNorm statistics move; the dataflow is the same), restoring each module's training flag after. A model
    with meta parameters and real buffers runs with its buffers seen as meta (`real_tensors_as_meta`)."""
    modules = list(model.modules())
    was_training = {m: m.training for m in modules}
    state = module_state(modules)
    model.eval()
    try:
        with torch.no_grad(), real_tensors_as_meta(modules), mode:
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
