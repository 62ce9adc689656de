"""`context_parallel(model, cp_comm)`: one call after conversion that splits the model's sequences over cp ranks.

It is applied to a model as it is (plain, or converted by `tpkit.parallelize` / `from_pretrained`: cp x tp), as
torchtitan applies its parallelisms in turn, and changes four things, each recorded on the model's record
(`record.context`):
1. the attention: `config._attn_implementation` becomes tpkit's context-parallel function (`attention.py`), which
   runs each layer's method around the kernel the model ran before (`sdpa` or `eager`);
2. the model's forward: a pre-hook keeps this rank's zigzag tokens of the whole sequences it is given, with global
   positions, labels shifted over the whole sequence and the masks' inputs (`batch.py`); a hook after it sums the
   ranks' loss shares into the global token mean (all-reduce forward, identity backward);
3. the gradients: every weight's gradient summed over cp (`grads.py`);
4. nothing else: state-dict keys and checkpoints do not depend on cp.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Iterator

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..nn.decode_attention import uses_attention_interface
from ..nn.mappings import reduce_from_region
from ..nn.record import ModelRecord, attach_record, record_of
from ..nn.split_logits import gather_logits
from .attention import KERNELS, LAYER_ATTR, METHODS, NAME, LayerContext, context_attention
from .batch import ContextBatch, shard_inputs
from .grads import sum_over_context


@dataclasses.dataclass(eq=False)
class ContextParallel:
    """The record of a context-parallel model: the cp group, the method asked for, the kernel the attention runs,
    the attention layers, the method each layer took and why (filled at the first forward: it reads the local
    heads), the current forward's batch, and whether cp is switched off (`context_off`)."""

    comm: Communicator
    method: str
    kernel: str
    layers: tuple[str, ...]
    methods: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    batch: ContextBatch | None = None
    off: bool = False

    def before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        if self.off:
            return None
        if args:
            names = list(inspect.signature(type(module).forward).parameters)[1:]
            kwargs = {**dict(zip(names, args)), **kwargs}
        if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
            raise NotImplementedError(
                "context parallelism: a K/V cache (generate, use_cache=True) reads every earlier token's K/V on every "
                "rank; decode with the split switched off: `with tpkit.context_off(model): model.generate(...)`")
        kwargs, self.batch = shard_inputs(kwargs, self.comm.rank, self.comm.world_size)
        return (), kwargs

    def after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output):
        if self.off:
            return None
        loss = output.get("loss") if isinstance(output, dict) else None
        if loss is not None:
            output["loss"] = reduce_from_region(loss, self.comm)
        return output


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside `model` (a PEFT wrapper's base model), whose config picks the attention."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise TypeError(f"context_parallel: {type(model).__name__} is not a Hugging Face model (no config with an "
                        f"attention implementation); context parallelism reaches attention through transformers' "
                        f"AttentionInterface")
    return base


def attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention layers reached through the AttentionInterface, each checked for what cannot be split."""
    config = model.config
    for attr, what in (("attn_logit_softcapping", "logit soft-capping"), ("attention_chunk_size", "chunked attention")):
        if getattr(config, attr, None):
            raise NotImplementedError(f"context_parallel: {type(model).__name__} uses {what} ({attr}="
                                      f"{getattr(config, attr)}), which tpkit cannot split over the sequence exactly")
    layers = [(n, m) for n, m in model.named_modules() if uses_attention_interface(m)]
    inside = tuple(f"{n}." for n, _ in layers)
    unreached = [f"{n} ({type(m).__name__})" for n, m in model.named_modules()
                 if "Attention" in type(m).__name__ and not uses_attention_interface(m) and not n.startswith(inside)
                 and any(True for _ in m.parameters())]
    if layers and unreached:  # it would attend over this rank's tokens only: refused, never silently partial
        raise NotImplementedError(f"context_parallel: attention layer(s) {', '.join(unreached[:4])} of "
                                  f"{type(model).__name__} do not dispatch through transformers' AttentionInterface "
                                  f"(config._attn_implementation), so tpkit cannot split their sequence")
    if not layers:
        raise NotImplementedError(f"context_parallel: no attention layer of {type(model).__name__} calls transformers' "
                                  f"AttentionInterface, the one way tpkit reaches attention; a custom model's "
                                  f"attention must dispatch on config._attn_implementation")
    for name, m in layers:
        if not getattr(m, "is_causal", True):
            raise NotImplementedError(f"context_parallel: layer {name} ({type(m).__name__}) is bidirectional; tpkit's "
                                      f"context parallelism splits causal language models")
        if isinstance(getattr(m, "sinks", None), torch.Tensor):
            raise NotImplementedError(f"context_parallel: layer {name} ({type(m).__name__}) uses attention sinks, "
                                      f"which tpkit cannot split over the sequence exactly")
    return layers


def context_parallel(model: nn.Module, cp_comm: Communicator, method: str = "auto") -> nn.Module:
    """Make `model` context-parallel over `cp_comm` (see the module docstring); returns it. Checks everything
    before changing anything: a refused model is left as it was."""
    from transformers import AttentionInterface

    if method not in METHODS:
        raise ValueError(f"context_parallel: method {method!r}; choose one of {METHODS}")
    if not isinstance(cp_comm, Communicator):
        raise TypeError(f"context_parallel: cp_comm must be a tpkit Communicator (tpkit.comm.groups(...).cp), got "
                        f"{type(cp_comm).__name__}")
    hf = hf_model(model)
    record = record_of(hf)
    if record is not None and record.context is not None:
        raise ValueError(f"context_parallel: {type(hf).__name__} is already context-parallel over "
                         f"{record.context.comm.name}")
    kernel = hf.config._attn_implementation
    if kernel not in KERNELS:
        raise NotImplementedError(f"context_parallel: {type(hf).__name__} runs attention kernel {kernel!r}; tpkit's "
                                  f"context parallelism wraps {KERNELS} (load the model with attn_implementation="
                                  f"'sdpa')")
    layers = attention_layers(hf)
    AttentionInterface.register(NAME, context_attention)
    state = ContextParallel(cp_comm, method, kernel, tuple(n for n, _ in layers))
    for name, m in layers:
        m.__dict__[LAYER_ATTR] = LayerContext(state, name)
    hf.config._attn_implementation = NAME
    hf.register_forward_pre_hook(state.before, with_kwargs=True)
    hf.register_forward_hook(state.after, with_kwargs=True)
    sum_over_context(hf, cp_comm)
    if record is None:
        record = attach_record(hf, ModelRecord(None, {}))
    record.context = state
    return model


def context_of(model: nn.Module) -> ContextParallel:
    record = record_of(hf_model(model))
    if record is None or record.context is None:
        raise ValueError(f"{type(model).__name__} is not context-parallel (tpkit.context_parallel)")
    return record.context


def gather_sequence(t: torch.Tensor, model: nn.Module, dim: int = 1) -> torch.Tensor:
    """The whole sequence of an output of the last forward (logits, hidden states: this rank's tokens along
    `dim`), in natural order with the split's padding cut. Collective over the cp group (and, for logits a TP head
    keeps split over the vocabulary, over its TP group first)."""
    state = context_of(model)
    if state.batch is None:
        raise ValueError("gather_sequence: the model has not run a context-parallel forward yet")
    return state.batch.split.gather(gather_logits(t), state.comm, dim)


@contextlib.contextmanager
def context_off(model: nn.Module) -> Iterator[nn.Module]:
    """Run the model whole on every cp rank, without gradients, inside the block (generation: decoding reads the
    whole K/V cache); the split is back afterwards."""
    state, hf = context_of(model), hf_model(model)
    state.off, hf.config._attn_implementation = True, state.kernel
    try:
        with torch.no_grad():
            yield model
    finally:
        state.off, hf.config._attn_implementation = False, NAME
