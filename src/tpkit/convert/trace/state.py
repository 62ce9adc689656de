"""What a forward leaves behind in a model's modules besides parameters and buffers, saved before the trace's
forward and put back after it, so tracing a model changes nothing in it."""
from __future__ import annotations

import copy

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
