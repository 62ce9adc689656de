"""The attention function context parallelism registers with Hugging Face's `AttentionInterface`.

A model made context-parallel has `config._attn_implementation = "tpkit_context"`; each attention layer then calls
`context_attention` with its queries, keys and values (after its own projections, norms and rotary embedding at
global positions), and it runs the layer's method over the cp group around the model's own kernel (`sdpa` or
`eager`, what the model ran before): all-to-all (`ulysses.py`) or ring (`ring.py`). Hugging Face builds no mask
for a custom attention name; the masks come from the forward's `ContextBatch` (padding, packed documents) and the
layer's own arguments (a sliding window). What cannot be split exactly is refused naming the layer: logit
soft-capping, attention sinks, attention dropout in the ring.
"""
from __future__ import annotations

import dataclasses

import torch

from .ring import ring_attention
from .ulysses import heads_fit, ulysses_attention

NAME = "tpkit_context"
KERNELS = ("sdpa", "eager")
METHODS = ("auto", "all_to_all", "ring")
LAYER_ATTR = "_tp_context"
_UNSPLITTABLE = {"softcap": "logit soft-capping", "s_aux": "attention sinks", "sinks": "attention sinks"}


@dataclasses.dataclass(eq=False)
class LayerContext:
    """What one attention layer knows of its context parallelism: the model's state and its own name."""

    state: "object"
    name: str

    def method(self, heads: int, kv_heads: int) -> str:
        """The layer's method for these local heads, chosen once (the same on every cp rank) and recorded."""
        chosen = self.state.methods.get(self.name)
        if chosen is None:
            cp, asked = self.state.comm.world_size, self.state.method
            why = heads_fit(heads, kv_heads, cp)
            if asked == "all_to_all" and why:
                raise ValueError(f"context_parallel(method='all_to_all'): layer {self.name}: {why}; "
                                 f"use method='ring' (splits no heads) or 'auto'")
            if asked == "ring":
                chosen = ("ring", "asked for")
            elif why:
                chosen = ("ring", why)
            else:
                chosen = ("all_to_all", f"{heads} query / {kv_heads} K/V local heads split over cp {cp}")
            self.state.methods[self.name] = chosen
        return chosen[0]


def context_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                      dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """HF's attention-function signature: [batch, heads, local tokens, dim] in, [batch, local tokens, heads, dim]
    out (and no weights)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    layer: LayerContext | None = module.__dict__.get(LAYER_ATTR)
    if layer is None:
        raise RuntimeError(f"{type(module).__name__} runs tpkit's context-parallel attention but "
                           f"tpkit.context_parallel did not set it up (a layer added afterwards?); apply "
                           f"context_parallel to the whole model")
    state = layer.state
    batch = state.batch
    if batch is None:
        raise RuntimeError(f"layer {layer.name}: context-parallel attention called outside its model's forward (no "
                           f"sequence split); call the model itself with whole sequences")
    for key_name, what in _UNSPLITTABLE.items():
        if kwargs.get(key_name) is not None:
            raise NotImplementedError(f"context parallelism: layer {layer.name} uses {what}, which tpkit cannot split "
                                      f"over the sequence exactly")
    window = kwargs.pop("sliding_window", None)
    kwargs.pop("position_ids", None)  # local and global positions are the batch's business, not the kernel's
    method = layer.method(query.shape[1], key.shape[1])
    if method == "ring":
        if dropout:
            raise NotImplementedError(f"context parallelism: layer {layer.name} has attention dropout {dropout} in "
                                      f"training; the ring cannot replay it (method='all_to_all' or dropout 0)")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return ring_attention(query, key, value, state.comm, batch, scale, window).transpose(1, 2), None
    kernel = ALL_ATTENTION_FUNCTIONS[state.kernel]
    out = ulysses_attention(module, query, key, value, state.comm, batch, kernel, state.kernel, window,
                            dropout=dropout, scaling=scaling, **kwargs)
    return out, None
