"""Activation recomputation ("activation checkpointing") for converted models: keep less for the backward, compute
it again there.

`recompute(model, policy)`:

- `"full"`: each block (the units `data_parallel` gives FSDP2: Hugging Face's `_no_split_modules`, else the
  children of the longest ModuleList) runs under `torch.utils.checkpoint` (non-reentrant): only its inputs are
  kept, and the backward runs its forward again, collectives included (every rank recomputes the same blocks in
  the same order, so they pair up as in the forward). Hugging Face layers are switched through their own
  `gradient_checkpointing` (which also turns off the KV cache, which a recompute would update twice), in training
  mode; other blocks get a checkpointed `forward` whenever autograd records.
- `"selective"`: only the attention core of each attention module (scores, softmax, dropout, weights x values;
  the O(seq^2) activations, cheap to compute again), through Hugging Face's attention interface. A rank's heads
  are its own, so nothing inside is communicated and nothing is sent twice. This is what tpkit's estimates call
  selective (Korthikanti et al. 2022). Models without that interface are refused, naming "full".
- `"none"`: nothing (undoes an earlier call).

Dropout: checkpoint restores torch's default generator for the recompute, but dropout under
`get_rng_tracker().fork()` draws from the tracker's streams, which the forward has advanced by then: the recompute
would draw another mask and the gradients would be wrong. Each checkpointed region snapshots the tracker on entry
and recomputes from that snapshot, putting the advanced states back after (as Megatron's CheckpointFunction does).

Where it lives: next to `data_parallel`, not inside it (it applies to plain TP too) nor in the converter. It wraps
the blocks' `forward` in place (a bound method on the instance, which `copy.deepcopy` rebinds), so state_dict keys,
checkpoints and FSDP2's units stay as they are; call it before or after `data_parallel`. Outside autograd
(`no_grad`, eval) the wrapped forward is the plain one.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .data_parallel import data_parallel_of, repeated_blocks
from .nn import communicator_of, get_rng_tracker

POLICIES = ("none", "selective", "full")
ATTENTION = "tpkit_recompute"  # the name under which the checkpointed attention core is registered with transformers


def recompute(model: nn.Module, policy: str = "full", blocks=None) -> nn.Module:
    """Recompute activations in the backward by `policy` ("full", "selective" or "none"); returns `model`.
    `blocks`: the modules "full" checkpoints (default: the model's repeated blocks)."""
    if policy not in POLICIES:
        raise ValueError(f"recompute: policy {policy!r} is not one of {POLICIES}")
    base = _inner(model)
    _undo(base)
    if policy == "full":
        found = list(blocks) if blocks is not None else repeated_blocks(base)
        if not found:
            raise ValueError(f"recompute: {type(base).__name__} has no repeated blocks (no _no_split_modules, no "
                             f"ModuleList); pass blocks=[...]")
        for block in found:
            if _hf_layer(block):  # its own switch: it also turns the KV cache off, which a recompute would update twice
                block.gradient_checkpointing = True
                block._gradient_checkpointing_func = _hf_checkpoint
            else:
                block.forward = types.MethodType(_checkpointed_forward, block)
    elif policy == "selective":
        attention = _attention_modules(base)
        if not attention:
            raise ValueError(f"recompute: 'selective' recomputes the attention core through Hugging Face's attention "
                             f"interface, and {type(base).__name__} has no module that uses it; use 'full'")
        _register()
        for m in attention:
            m._tpkit_recompute_config = m.config
            inner = m.config._attn_implementation
            m.config = copy.copy(m.config)  # this module's own: the model's config (and its masks) stay as they are
            m.config._attn_implementation = ATTENTION
            m._tpkit_recompute_attention = inner
    return model


def tracker_contexts(comm):
    """`context_fn` for `torch.utils.checkpoint`: the forward runs as it is; the recompute runs with the RNG
    tracker's states as they were when the forward started, and leaves them as the forward left them."""
    tracker = get_rng_tracker(comm)
    start = tracker.get_states()

    @contextlib.contextmanager
    def from_start():
        advanced = tracker.get_states()
        tracker.set_states(start)
        try:
            yield
        finally:
            tracker.set_states(advanced)

    return contextlib.nullcontext(), from_start()


def _checkpointed_forward(self, *args, **kwargs):
    forward = types.MethodType(type(self).forward, self)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False,
                      context_fn=lambda: tracker_contexts(communicator_of(self)), **kwargs)


def _hf_checkpoint(function, *args):
    """The checkpoint function a Hugging Face layer calls (`_gradient_checkpointing_func`) with
    `partial(forward, layer, **kwargs)`."""
    layer = function.args[0]
    return checkpoint(function, *args, use_reentrant=False, context_fn=lambda: tracker_contexts(communicator_of(layer)))


def _hf_layer(block: nn.Module) -> bool:
    """A Hugging Face layer (known by its class's name: transformers is not imported for a block that is not one)."""
    return any(c.__name__ == "GradientCheckpointingLayer" and c.__module__ == "transformers.modeling_layers"
               for c in type(block).__mro__)


def _checkpointed_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention interface entry: the module's own implementation, under checkpoint."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(inspect.getmodule(type(module)), "eager_attention_forward")
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(module._tpkit_recompute_attention, eager)
    if not torch.is_grad_enabled():
        return inner(module, query, key, value, attention_mask, **kwargs)
    return checkpoint(inner, module, query, key, value, attention_mask, use_reentrant=False,
                      context_fn=lambda: tracker_contexts(communicator_of(module)), **kwargs)


def _register() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION, _checkpointed_attention)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """Modules that call Hugging Face's attention interface: an attention class with a config whose modeling file
    defines `eager_attention_forward`."""
    out = []
    for m in model.modules():
        config = getattr(m, "config", None)
        if "Attention" in type(m).__name__ and hasattr(config, "_attn_implementation") and \
                hasattr(inspect.getmodule(type(m)), "eager_attention_forward"):
            out.append(m)
    return out


def _undo(model: nn.Module) -> None:
    for m in model.modules():
        if m.__dict__.get("_gradient_checkpointing_func") is _hf_checkpoint:
            del m._gradient_checkpointing_func
            m.gradient_checkpointing = False
        if isinstance(m.__dict__.get("forward"), types.MethodType) and \
                m.__dict__["forward"].__func__ is _checkpointed_forward:
            del m.forward
        if "_tpkit_recompute_config" in m.__dict__:
            m.config = m.__dict__.pop("_tpkit_recompute_config")


def _inner(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 returns the model itself)."""
    record = data_parallel_of(model)
    return record.module if record is not None else model
