"""Real memory for a model built on the meta device, before a load fills it: parameters allocated at their (local)
shapes on the load's device, ties kept; buffers put there too; non-persistent buffers computed, not guessed.

A checkpoint holds parameters and persistent buffers only. A non-persistent buffer (a rotary `inv_freq`, BERT's
`position_ids`) is computed by its module's `__init__`. `from_pretrained` builds with parameters alone on meta
(`meta_parameters`), so its buffers are real from the start. A model built entirely under
`torch.device("meta")` never computed them, and `to_empty()` leaves garbage there: silently wrong logits. For
such a Hugging Face model, tpkit builds the same class from the model's config the `from_pretrained` way and
takes those buffers by name (the conversion leaves them alone: they are per model, not per rank); any other
model with a non-persistent buffer on meta is refused before anything changes.

A meta parameter becomes real in place (`torch.utils.swap_tensors`): the Parameter object stays the same, so
tied weights stay one tensor and an optimizer built on the meta model still holds the model's parameters.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..convert.transformers_threads import building
from .errors import CheckpointError
from .memory import empty_for_load


# In-place initializers (torch.nn.init's and the tensor methods they call): on a meta tensor they have nothing to
# write, yet run torch's meta kernels, which are Python (`torch._refs`): 14 of a 0.64 GB Llama's 20 ms build.
INITIALIZERS = frozenset({"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                          "xavier_uniform_", "xavier_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                          "orthogonal_", "sparse_", "fill_", "zero_"})


class _SkipMetaInit(TorchFunctionMode):
    """An initializer (`INITIALIZERS`) called on a meta tensor returns it as it is; everything else runs. Torch
    function modes are per thread: other thread-ranks' builds and real tensors (the buffers) are untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in INITIALIZERS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_parameters(dtype: torch.dtype | None) -> Iterator[None]:
    """Parameters registered inside go to the meta device; buffers stay real (computed by the module's init).
    Floating defaults are `dtype` inside, as transformers builds its models. Only the building thread's
    parameters go to meta (thread-ranks may be building other models meanwhile).

    The default dtype is process-wide (torch has no per-thread one, and transformers sets it itself while it
    builds: passing it `dtype=` instead would switch it just the same), so the build holds `building`'s lock:
    one build at a time. Parameters go to meta through torch's own parameter-registration hook
    (`register_module_parameter_registration_hook`), removed after the build; their initializers are skipped
    (`INITIALIZERS`: nothing to write on meta)."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    builder = threading.get_ident()

    def to_meta(module, name, param):
        if param.device.type != "meta" and threading.get_ident() == builder:
            return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        return None

    with building(dtype):
        handle = register_module_parameter_registration_hook(to_meta)
        try:
            with _SkipMetaInit():
                yield
        finally:
            handle.remove()


def empty_on(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised memory for a load: huge-page advised on the CPU (`memory.py`), plain elsewhere."""
    return empty_for_load(shape, dtype) if device.type == "cpu" else torch.empty(shape, dtype=dtype, device=device)


def non_persistent_meta_buffers(model: nn.Module) -> list[str]:
    """Names of the non-persistent buffers still on the meta device (no checkpoint holds them)."""
    return [f"{prefix}{'.' if prefix else ''}{name}" for prefix, m in model.named_modules()
            for name, b in m._buffers.items() if b is not None and b.is_meta and name in m._non_persistent_buffers_set]


def computed_buffers(model: nn.Module, where: str) -> dict[str, torch.Tensor]:
    """Values of the model's non-persistent meta buffers, as its class computes them from its config (a Hugging
    Face model built the `from_pretrained` way: parameters on meta, buffers real), in the buffer's dtype.
    Raises CheckpointError naming them and the fix when that is not possible."""
    names = non_persistent_meta_buffers(model)
    if not names:
        return {}
    config = getattr(model, "config", None)
    build = getattr(type(model), "_from_config", None)
    problem = None if config is not None and build is not None else "the model has no Hugging Face config to rebuild them from"
    built = {}
    if problem is None:
        try:
            with meta_parameters(None):
                built = dict(build(config).named_buffers())
        except Exception as exc:  # a model whose class cannot be built from its config
            problem = f"rebuilding {type(model).__name__} from its config failed ({type(exc).__name__}: {exc})"
    metas = dict(model.named_buffers())
    out = {}
    for name in names:
        value = built.get(name)
        if problem is None and (value is None or value.is_meta or value.shape != metas[name].shape):
            problem = f"{type(model).__name__} built from its config has no buffer {name} of shape " \
                      f"{list(metas[name].shape)}"
        if problem is not None:
            break
        out[name] = value.to(metas[name].dtype)
    if problem is not None:
        raise CheckpointError(f"{where}: the model's non-persistent buffers {names[:3]}{' ...' if len(names) > 3 else ''} "
                              f"are on the meta device; checkpoints never hold them and {problem}. Build the model "
                              f"with real buffers (parameters alone on meta), or use tpkit.from_pretrained(path), "
                              f"which does")
    return out


def swap_in(old: torch.Tensor, new: torch.Tensor, holders: list[tuple[dict, str]]) -> torch.Tensor:
    """Make `old` hold `new`'s data, keeping the object (ties, optimizer references); when torch cannot swap
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


def materialize(model: nn.Module, device: torch.device, buffers: dict[str, torch.Tensor] | None = None,
                optimizer=None) -> None:
    """Give every meta parameter and buffer of `model` uninitialised memory on `device` at its current (local)
    shape, a tensor shared by several modules staying one tensor; meta buffers named in `buffers` take those
    values instead. Then the load fills the rest. `optimizer`: its references follow a replaced parameter."""
    buffers = buffers or {}
    holders: dict[int, list[tuple[dict, str]]] = {}
    tensors: dict[int, tuple[torch.Tensor, str]] = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None and t.is_meta:
                    holders.setdefault(id(t), []).append((table, name))
                    tensors.setdefault(id(t), (t, f"{prefix}{'.' if prefix else ''}{name}"))
    replaced = {}
    for key, (t, name) in tensors.items():
        value = buffers[name].to(device) if name in buffers else empty_on(t.shape, t.dtype, device)
        now = swap_in(t, value, holders[key])
        if now is not t:
            replaced[key] = now
    if optimizer is not None and replaced:
        for group in optimizer.param_groups:
            group["params"] = [replaced.get(id(p), p) for p in group["params"]]


def place_buffers(model: nn.Module, device: torch.device) -> None:
    """Move every buffer to `device` (one shared by several modules stays one tensor)."""
    moved: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[name] = moved.setdefault(id(b), b.to(device))
