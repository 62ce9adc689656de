"""Real memory for a model built on the meta device, before a load fills it: parameters allocated at their (local)
shapes on the load's device, ties kept; buffers put there too.

`from_pretrained` builds with parameters alone on meta (`meta_parameters`), so its buffers (a rotary `inv_freq`,
computed by the module's `__init__` and never saved) are real from the start and only need moving.

A meta parameter becomes real in place (`torch.utils.swap_tensors`): the Parameter object stays the same, so
tied weights stay one tensor.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch import nn

from .memory import empty_for_load

# Building patches nn.Module.register_parameter and the default dtype process-wide: one build at a time.
_BUILD_LOCK = threading.Lock()


@contextlib.contextmanager
def meta_parameters(dtype: torch.dtype | None) -> Iterator[None]:
    """Parameters registered inside go to the meta device; buffers stay real (computed by the module's init).
    Floating defaults are `dtype` inside, as transformers builds its models. Only the building thread's
    parameters go to meta (thread-ranks may be building other models meanwhile)."""
    with _BUILD_LOCK:  # read the original inside the lock, or a waiting build would restore our patch
        original, builder = nn.Module.register_parameter, threading.get_ident()

        def register(self, name, param):
            if param is not None and param.device.type != "meta" and threading.get_ident() == builder:
                param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            original(self, name, param)

        saved_dtype = torch.get_default_dtype()
        nn.Module.register_parameter = register
        try:
            if dtype is not None and dtype.is_floating_point:
                torch.set_default_dtype(dtype)
            yield
        finally:
            nn.Module.register_parameter = original
            torch.set_default_dtype(saved_dtype)


def empty_on(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised memory for a load: huge-page advised on the CPU (`memory.py`), plain elsewhere."""
    return empty_for_load(shape, dtype) if device.type == "cpu" else torch.empty(shape, dtype=dtype, device=device)


def swap_in(old: torch.Tensor, new: torch.Tensor, holders: list[tuple[dict, str]]) -> torch.Tensor:
    """Make `old` hold `new`'s data, keeping the object (ties, references held elsewhere); when torch cannot swap
    (a weak reference to it, say), put `new` in `holders` (the module dicts naming `old`) instead."""
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(new, requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)  # tensor-parallel attributes set by the layers
    try:
        torch.utils.swap_tensors(old, new)
        return old
    except RuntimeError:
        for table, name in holders:
            table[name] = new
        return new


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer of `model` uninitialised memory on `device` at its current (local)
    shape, a tensor shared by several modules staying one tensor. Then the load fills it."""
    holders: dict[int, list[tuple[dict, str]]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for m in model.modules(remove_duplicate=False):
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None and t.is_meta:
                    holders.setdefault(id(t), []).append((table, name))
                    tensors.setdefault(id(t), t)
    for key, t in tensors.items():
        swap_in(t, empty_on(t.shape, t.dtype, device), holders[key])


def place_buffers(model: nn.Module, device: torch.device) -> None:
    """Move every buffer to `device` (one shared by several modules stays one tensor)."""
    moved: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[name] = moved.setdefault(id(b), b.to(device))
