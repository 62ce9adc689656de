"""A pipeline stage built from a model by module names: the model with the other stages' modules taken out.

torch's tracing front-end (`torch.distributed.pipelining.pipeline()`) fails on Hugging Face models with rotary
embeddings, so stages are cut by name instead. This rank's part of the model (`prune`) is the model itself with
every block another stage holds replaced by a `HeldElsewhere` placeholder (no parameters: the state dict keeps
exactly this rank's keys, under their full-model names), the modules before the blocks (embeddings) only on the
first stage and those after (final norm, LM head) only on the last.

A stage's forward (`StageModule`) runs the model's own forward, so whatever the model computes between its
blocks (position ids, the causal mask, rotary tables, which every stage computes from the rotary module it keeps)
is computed as the model computes it:
- the first stage is called with the token ids; a later stage with the hidden states it received, as
  `inputs_embeds` (a Hugging Face model) or as the first argument (any other), and a forward pre-hook on its
  first block replaces that block's input with them, whatever the model did to them before its blocks;
- the placeholders of the blocks before and after pass their input through; placeholders of the modules before
  the blocks return a zero (their output only feeds what the first real block's hook replaces);
- a stage that is not the last returns its last block's output (a forward hook keeps it); the last stage returns
  the model's output (a Hugging Face model's `logits`).
Under context parallelism (`context`) each stage is also handed the micro-batch's whole token ids and cuts them
over cp itself: the first stage its ids, every stage its tokens' global positions and the forward's split (a later
stage's hidden states are this rank's tokens already; see `tpkit.context.pipeline`).
With several stages on one rank (interleaved schedules) each `StageModule` runs a shell of the rank's part: the
same layers, with the containers on the way to the other stage's blocks copied to hold placeholders there.
Hugging Face decoder layers must return their hidden states as a tensor (transformers 5).
"""
from __future__ import annotations

import copy
import inspect
from typing import Any, Iterable

import torch
from torch import nn

from ..context.pipeline import StageContext
from ..nn.record import ModelRecord
from .split import StageSplit

_PLAIN = (int, float, str, bool, type(None))
# nn.Module bookkeeping a shell copies rather than shares (a hook registered on a shell must not fire on the part).
_TABLES = ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set", "_forward_hooks",
           "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
           "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
           "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


class HeldElsewhere(nn.Module):
    """Stands where a module another pipeline stage holds was: no parameters; `kind` "block" and "after" pass their
    first input through, "before" returns a zero. Plain attributes of the module it replaces (a layer's
    `attention_type`, its index) are kept, for models that read them off their layers."""

    def __init__(self, name: str, stage: int, kind: str, replaced: nn.Module | None = None):
        super().__init__()
        self.held_name, self.held_by, self.kind = name, stage, kind
        for k, v in vars(replaced or nn.Module()).items():
            if not k.startswith("_") and k != "training" and isinstance(v, _PLAIN) and k not in vars(self):
                setattr(self, k, v)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.kind == "before":
            first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
            device = first.device if first is not None else None
            return torch.zeros((), dtype=torch.get_default_dtype(), device=device)
        if args:
            return args[0]
        return kwargs.get("hidden_states", next(iter(kwargs.values()), None))

    def extra_repr(self) -> str:
        return f"{self.held_name} held by stage {self.held_by}"


def held_names(split: StageSplit, stages: Iterable[int]) -> set[str]:
    """The module names a rank holding `stages` keeps (blocks, first and last modules)."""
    stages = set(stages)
    out = {f"{split.blocks}.{i}" for s in stages for i in split.stage_blocks(s)}
    if 0 in stages:
        out.update(split.first)
    if split.num_stages - 1 in stages:
        out.update(split.last)
    return out


def placeholders(model: nn.Module, split: StageSplit, keep: set[str]) -> dict[str, HeldElsewhere]:
    """A `HeldElsewhere` for every block and outside module of `model` not in `keep` (and not one already)."""
    out = {}
    for i in range(split.num_blocks):
        name = f"{split.blocks}.{i}"
        if name not in keep:
            out[name] = HeldElsewhere(name, split.stage_of_block(i), "block", model.get_submodule(name))
    for kind, names, stage in (("before", split.first, 0), ("after", split.last, split.num_stages - 1)):
        for name in names:
            if name not in keep:
                out[name] = HeldElsewhere(name, stage, kind)
    return {n: m for n, m in out.items() if not isinstance(model.get_submodule(n), HeldElsewhere)}


def prune(model: nn.Module, split: StageSplit, stages: Iterable[int]) -> nn.Module:
    """`model`, in place, holding only the modules of `stages` (placeholders elsewhere); returns it."""
    for name, holder in placeholders(model, split, held_names(split, stages)).items():
        parent, _, leaf = name.rpartition(".")
        (model.get_submodule(parent) if parent else model)._modules[leaf] = holder
    return model


def _shallow(m: nn.Module) -> nn.Module:
    """A new module object of `m`'s class sharing its children, parameters and settings, with its own tables (so
    what is put into the copy, or registered on it, stays out of `m`) and without `m`'s tpkit record."""
    new = copy.copy(m)
    for attr in _TABLES:
        if attr in m.__dict__:
            new.__dict__[attr] = copy.copy(m.__dict__[attr])
    for k in [k for k, v in new.__dict__.items() if isinstance(v, ModelRecord)]:
        del new.__dict__[k]
    return new


def shell(model: nn.Module, replace: dict[str, nn.Module]) -> nn.Module:
    """`model` with the modules named in `replace` replaced, without changing `model`: the containers on the way
    to them are shallow copies (`_shallow`); every other module is the same object."""
    if not replace:
        return model
    root = _shallow(model)
    copies = {"": root}
    for name in sorted(replace, key=lambda n: n.count(".")):
        parts = name.split(".")
        for depth in range(1, len(parts)):
            path, parent = ".".join(parts[:depth]), ".".join(parts[:depth - 1])
            if path not in copies:
                copies[path] = _shallow(copies[parent]._modules[parts[depth - 1]])
                copies[parent]._modules[parts[depth - 1]] = copies[path]
        copies[".".join(parts[:-1])]._modules[parts[-1]] = replace[name]
    return root


def feeds_embeddings(model: nn.Module) -> bool:
    """Whether `model` is driven with `inputs_embeds` (a Hugging Face model whose forward takes them)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return getattr(model, "config", None) is not None and "inputs_embeds" in params


class StageModule(nn.Module):
    """Pipeline stage `stage` of `num_stages`: the module torch's `PipelineStage` runs (see the module docstring).
    `module` is the shell of the rank's part for this stage; its blocks `first_block` .. `last_block`."""

    def __init__(self, module: nn.Module, split: StageSplit, stage: int, embeds: bool,
                 context: StageContext | None = None):
        super().__init__()
        self.module = module
        self.stage, self.num_stages, self.embeds, self.context = stage, split.num_stages, embeds, context
        blocks = split.stage_blocks(stage)
        lst = module.get_submodule(split.blocks)
        self.__dict__["first_block"] = lst[blocks.start]  # not registered: the shell holds them
        self.__dict__["last_block"] = lst[blocks.stop - 1]
        params = inspect.signature(self.first_block.forward).parameters
        self.hidden_name = next(iter(params), "hidden_states")

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """`x`: the token ids (first stage) or the hidden states received; `tokens`: the micro-batch's whole token
        ids, which a context-parallel stage cuts (`context`; any other ignores them)."""
        kept: list = []
        handles = []
        if not self.is_first:
            handles.append(self.first_block.register_forward_pre_hook(self._replace_input(x), with_kwargs=True,
                                                                       prepend=True))
        if not self.is_last:
            handles.append(self.last_block.register_forward_hook(lambda m, args, out: kept.append(out)))
        try:
            out = self._run(x, tokens)
        finally:
            for h in handles:
                h.remove()
        if not self.is_last:
            out = kept[-1]
            return out[0] if isinstance(out, (tuple, list)) else out
        return model_output(out)

    def _run(self, x: torch.Tensor, tokens: torch.Tensor | None) -> Any:
        """The model's forward on this stage's input (cut over cp first by a context-parallel stage)."""
        if self.context is not None:
            kwargs = self.context.inputs(x if self.is_first else tokens, None if self.is_first else x)
            with self.context.caller_cuts():
                return self.module(**kwargs)
        if self.embeds:
            key = "input_ids" if self.is_first else "inputs_embeds"
            return self.module(**{key: x}, use_cache=False)
        return self.module(x)

    def _replace_input(self, x: torch.Tensor):
        def hook(module, args, kwargs):
            if args:
                return (x,) + tuple(args[1:]), kwargs
            return args, {**kwargs, self.hidden_name: x}
        return hook

    def extra_repr(self) -> str:
        return f"stage {self.stage} of {self.num_stages}"


def model_output(out: Any) -> torch.Tensor:
    """The tensor a model's output stands for: a Hugging Face output's `logits`, a tuple's first element."""
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def stage_modules(part: nn.Module, split: StageSplit, stages: list[int],
                  context: StageContext | None = None) -> list[StageModule]:
    """One `StageModule` per stage this rank holds, over `part` (the pruned model): each runs a shell with the
    other stages' modules as placeholders (the part itself when the rank holds one stage); `context`: the part's
    context parallelism, which every stage cuts its inputs for."""
    embeds = feeds_embeddings(part)
    out = []
    for s in stages:
        keep = held_names(split, [s])
        out.append(StageModule(shell(part, placeholders(part, split, keep)), split, s, embeds, context))
    return out
