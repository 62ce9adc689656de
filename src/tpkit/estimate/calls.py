"""How the estimator calls a model it measures: an example as `(args, kwargs)`, a weightless copy to run, and a
weightless model of a config with a given number of layers (estimates trace 1 and 2 layers and extrapolate).

Shared by the measured step (`step`, `measure`) and the traced activations (`traced`), so both call a model
the same way and never touch the user's weights.
"""
from __future__ import annotations

import copy
import json
from typing import Any

import torch
from torch import nn

from .config import own_dtype
from .presets import build_model


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


def to_empty_tied(model: nn.Module, device: str = "cpu") -> nn.Module:
    """`model.to_empty(device=...)` keeping tied parameters tied: under `FakeTensorMode` `to_empty` gives each
    module its own new Parameter, so GPT-2's LM head and embedding became two weights, with two gradients and two
    sets of AdamW states (a 124M GPT-2's step was traced holding 0.6 GB it does not)."""
    refs: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                refs.setdefault(id(p), []).append((module, name))
    model = model.to_empty(device=device)
    for places in refs.values():
        first, name = places[0]
        for module, other in places[1:]:
            module._parameters[other] = first._parameters[name]
    return model


def config_with_layers(config, layers: int):
    """A copy of an HF config with `layers` transformer layers (per-layer type lists cut to match)."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    for name in ("layer_types", "block_types"):
        value = getattr(cfg, name, None)
        if isinstance(value, (list, tuple)) and len(value) >= layers:
            setattr(cfg, name, type(value)(value[:layers]))
    return cfg


def with_layers(config, model_cls, layers: int, dtype: torch.dtype, attention: str | None = None) -> nn.Module:
    """A weightless (meta) model of `config` with `layers` transformer layers, of `model_cls` or built from the
    config's own class, in `dtype` (transformers builds a config that names its dtype in that one); `attention`
    "eager" or anything else (sdpa) sets the attention kernel."""
    cfg = config_with_layers(config, layers)
    if attention is not None:
        cfg._attn_implementation = "eager" if attention == "eager" else "sdpa"
    if model_cls is None:
        return build_model(cfg, device="meta", dtype=dtype).to(dtype)
    with torch.device("meta"):
        model = model_cls(cfg)
    return model.to(dtype)


def _recipe(model_or_config, dtype: torch.dtype | None):
    """How `models_to_trace` makes its models: (config, the class to build or None for the config's own, [(the
    row's layer count, the layers to build)], the layer count to extrapolate to, dtype), or None where it copies
    the module itself (a module without a config, or of at most 2 layers)."""
    config = model_or_config if not isinstance(model_or_config, nn.Module) else getattr(model_or_config, "config",
                                                                                        None)
    layers = getattr(config, "num_hidden_layers", None) if config is not None else None
    cls = type(model_or_config) if isinstance(model_or_config, nn.Module) else None
    dtype = dtype or own_dtype(model_or_config)
    if isinstance(layers, int) and layers > 2 and hasattr(config, "model_type"):
        return config, cls, [(1, 1), (2, 2)], layers, dtype
    if isinstance(model_or_config, nn.Module):
        return None
    if config is not None and hasattr(config, "model_type"):
        return config, None, [(layers or 0, layers)], layers or 0, dtype
    raise TypeError(f"predict needs an nn.Module or a Hugging Face config, got {type(model_or_config).__name__}")


def models_to_trace(model_or_config, dtype: torch.dtype | None = None,
                    attention: str | None = None) -> tuple[list[tuple[int, nn.Module]], int]:
    """Weightless models for `predict` to trace, with their layer counts, and the layer count to extrapolate to (a
    config in `dtype`, default bfloat16 as the other estimates; a module keeps its own unless `dtype` says
    otherwise; a config rebuilt with `attention`'s kernel when given: "eager", else sdpa)."""
    recipe = _recipe(model_or_config, dtype)
    if recipe is None:
        return [(0, meta_copy(model_or_config).to(dtype or own_dtype(model_or_config)))], 0
    config, cls, rows, layers, dtype = recipe
    return [(n, with_layers(config, cls, build, dtype, attention)) for n, build in rows], layers


def trace_source(model_or_config, dtype: torch.dtype | None = None, attention: str | None = None) -> tuple | None:
    """What `models_to_trace` builds its models from, as a hashable value, where that is the config alone (the
    config's every field, the class, the layer counts, the dtype, the attention kernel); None where it copies a
    module, whose weights, adapters or code a value cannot stand for."""
    recipe = _recipe(model_or_config, dtype)
    if recipe is None:
        return None
    config, cls, rows, layers, dtype = recipe
    fields = json.dumps(config.to_dict(), sort_keys=True, default=repr)
    name = None if cls is None else f"{cls.__module__}.{cls.__qualname__}"
    return type(config).__qualname__, fields, name, tuple(rows), layers, str(dtype), attention
