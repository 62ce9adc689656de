"""The one small step a non-transformer module is measured on: its example call (`module_example`, which the speed
estimate traces too, so both estimate the very same call), the plan styles the converter would apply, and a
weightless copy of the model to run.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..convert import plan as make_plan
from ..convert.styles import REPLICATE
from .calls import as_call, meta_copy
from .report import MODES


def _planned_styles(model: nn.Module, world_size: int, mode: str, example) -> tuple[dict[str, str] | None, str]:
    """`{module name: style}` from the converter's planner (what `parallelize` will do), or None and why."""
    try:
        p = make_plan(model, world_size, mode=mode, example_inputs=example)
    except Exception as exc:  # noqa: BLE001 - fall back to the type rule, and say so
        return None, f"the planner failed ({type(exc).__name__}: {exc})"
    styles = {name: style for name in dict(model.named_modules()) if (style := p.style_for(name))}
    split = [n for n, st in styles.items() if st != REPLICATE]
    why = "" if split or not p.reasons else f"the plan splits nothing: {next(iter(p.reasons.values()))}"
    return styles, why


def _first_tensor(example) -> torch.Tensor | None:
    args, kwargs = as_call(example)
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


def _runnable_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A weightless (meta) copy in the estimate's dtype to trace one step on: the user's weights are never
    copied or run, and its BatchNorm statistics stay untouched."""
    return meta_copy(model).to(dtype)


def _example(model: nn.Module, dtype: torch.dtype, example_input, input_shape):
    if example_input is not None:
        def cast(v):
            return v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        args, kwargs = as_call(example_input)
        return (tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()})
    if input_shape is not None:
        first = next((m for m in model.modules() if isinstance(m, (nn.Embedding, nn.Linear, nn.Conv2d))), None)
        if isinstance(first, nn.Embedding):
            return (torch.zeros(tuple(input_shape), dtype=torch.long),), {}
        return (torch.randn(tuple(input_shape), dtype=dtype),), {}
    raise ValueError(f"estimate_memory: {type(model).__name__} is not a transformer with a Hugging Face config, and "
                     "no input follows from its first layer (an Embedding, Linear or Conv2d taking the one input of "
                     "its forward); pass example_input=... (a tensor, tuple or dict, batch first) or "
                     "input_shape=(batch, ...) so its activations can be measured on one small step")


def infer_input(model: nn.Module) -> torch.Tensor | None:
    """The smallest input the model's first layer takes, where that is unambiguous: its forward has one required
    argument, its first layer with parameters (registration order) is an Embedding (token ids (1, 8)), a Linear
    ((1, in_features)) or a Conv2d ((1, in_channels, 32, 32)), and the model runs on it (weightless, on meta).
    None otherwise."""
    try:
        required = [p for p in inspect.signature(model.forward).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return None
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if len(required) != 1 or first is None:
        return None
    own = next(first.parameters()).dtype
    if isinstance(first, nn.Embedding):
        x = torch.zeros(1, 8, dtype=torch.long)
    elif isinstance(first, nn.Linear):
        x = torch.zeros(1, first.in_features, dtype=own)
    elif isinstance(first, nn.Conv2d):
        x = torch.zeros(1, first.in_channels, 32, 32, dtype=own)
    else:
        return None
    try:
        with torch.no_grad():
            meta_copy(model)(x.to("meta"))
    except Exception:  # noqa: BLE001 - the guess does not fit this model: ask for an input
        return None
    return x


def prepare_module_step(model: nn.Module, world_size: int, dtype: torch.dtype, mode: str, example_input=None,
                        input_shape=None, seq_len: int | None = None) -> dict[str, Any]:
    """Everything a measured step needs: the example call, its batch, the plan styles (or why not), a
    runnable copy of the model. The memory estimate of non-transformer modules reads it."""
    args, kwargs, batch, notes = module_example(model, dtype, example_input, input_shape, seq_len)
    styles, planned = None, ()
    if world_size > 1:
        first_param = next(model.parameters(), None)
        device = first_param.device if first_param is not None else torch.device("cpu")
        own = first_param.dtype if first_param is not None else dtype

        def as_model(v):  # the planner traces the model itself: its device and dtype
            if not isinstance(v, torch.Tensor):
                return v
            return v.to(device, own) if v.is_floating_point() else v.to(device)
        planned = tuple(as_model(a) for a in args) if args else {k: as_model(v) for k, v in kwargs.items()}
        styles, why = _planned_styles(model, world_size, mode if mode in MODES else "inference", planned)
        if styles is None:
            notes.append(f"per-rank split by layer type (Linear/Conv2d pairs whose sizes divide, embeddings by "
                         f"vocabulary) because {why}")
        elif why:
            notes.append(why)
    work = _runnable_copy(model, dtype)
    work.train(mode == "training")
    return {"args": args, "kwargs": kwargs, "batch": batch, "styles": styles, "planned_inputs": planned, "work": work,
            "notes": notes}


def module_example(model: nn.Module, dtype: torch.dtype, example_input=None, input_shape=None,
                   seq_len: int | None = None) -> tuple[tuple, dict, int, list[str]]:
    """The example call a non-transformer module is estimated on, as (args, kwargs, its batch, notes): the given
    example (floating tensors in `dtype`), else an input of `input_shape`, else token ids of `seq_len` for a model
    that reads them, else the input its first layer implies (`infer_input`, said in a note); ValueError when none."""
    if example_input is None and input_shape is None and getattr(model, "main_input_name", "") == "input_ids":
        example_input = {"input_ids": torch.zeros(1, seq_len or 128, dtype=torch.long)}
    notes = []
    if example_input is None and input_shape is None:
        guessed = infer_input(model)
        if guessed is not None:
            example_input = guessed
            notes.append(f"input inferred from the first layer: {tuple(guessed.shape)} {str(guessed.dtype)[6:]} "
                         f"(pass example_input= or input_shape= for the real one)")
    args, kwargs = _example(model, dtype, example_input, input_shape)
    first = _first_tensor(args) if args else _first_tensor(kwargs)
    return args, kwargs, int(first.shape[0]) if first is not None and first.dim() else 1, notes
