"""How the estimator calls a model it measures: an example as `(args, kwargs)`, and a weightless copy to run.

Shared by the measured step (`step`, `measure`) and the traced activations (`traced`), so both call a model
the same way and never touch the user's weights.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def as_call(example) -> tuple[tuple, dict]:
    """An example input as `(args, kwargs)`: a dict is keywords, a tuple or list positions, else one argument."""
    if isinstance(example, dict):
        return (), example
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    return (example,), {}


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy whose parameters and buffers are meta tensors (the weights are never copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)
