"""A decode step's attention in half precision on the CPU, computed in float32: torch's own kernel, 4-9x faster there.

At one query row (a decode step) torch 2.13's CPU attention kernel (`scaled_dot_product_attention`, which
transformers' "sdpa" attention calls) is slow in bf16 and fp16 and fast in float32 (one 2-core EPYC thread, 16 query
heads over 4 key/value heads of 128: 98 us in bf16 against 15 in float32 at 40 cached tokens, 1.37 ms against 0.12
at 512, 11.1 ms against 1.3 at 4096). An int4 Llama of 8 layers (hidden 2048, one process) spent 0.5 ms of each
token there after a short prompt, and after a 500-token prompt more than 10 ms of its 23.

So a converted model's attention layers (those dispatching on transformers' `AttentionInterface`, marked by
`adopt_decode_attention`) take, at one query row on the CPU in bf16 / fp16 without a gradient or dropout, the float32
copies of the query, keys and values (and of a floating mask) into the same "sdpa" function, and round its output
back to their dtype. The sums are float32 either way (torch's half-precision kernel accumulates in float32 but
rounds the softmax weights to the half type before the values' product: this rounds nothing before the output), so
the result is at least as close to the exact one. Where the copies would be large (`MAX_COPY_BYTES`: beyond glibc's
reuse of freed blocks every copy faults fresh pages, and at 32 MHA heads over 4096 tokens the copies cost 3x what
they saved) the call is torch's as it was, as it is everywhere else: with a gradient, at more query rows, on a GPU,
in float32, and for every module not marked (a stock model in the same process runs transformers' own function).

Reached through transformers' registry: the "sdpa" entry is wrapped once, process-wide (`install`), and the wrapper
hands an unmarked module's call to the function it wrapped, untouched. The mark is an instance attribute, so it
survives `copy.deepcopy` and pickling; the model's config (what `save_pretrained` writes) is not touched.
"""
from __future__ import annotations

import threading

import torch
from torch import nn

from .sources import forward_source

MARK = "_tpkit_decode_attention"
MAX_COPY_BYTES = 16 << 20  # the largest float32 copy of the keys (or values) taken: under glibc's 32 MB mmap ceiling
HALF = (torch.bfloat16, torch.float16)
_LOCK = threading.Lock()
_WRAPPED: dict[str, object] = {}  # the "sdpa" function found in transformers' registry when `install` wrapped it


def uses_attention_interface(module: nn.Module) -> bool:
    """Whether `module`'s forward picks its attention from transformers' `AttentionInterface` by
    `config._attn_implementation` (read once per class from its source): the one way tpkit reaches an attention core."""
    source = forward_source(type(module))
    return "ALL_ATTENTION_FUNCTIONS" in source and "_attn_implementation" in source


def takes(query: torch.Tensor, key: torch.Tensor, dropout: float) -> bool:
    """Whether a call computes in float32 (the module docstring): one query row, bf16 / fp16 on the CPU, no gradient
    or dropout, keys small enough to copy. Shapes, dtypes and devices only: nothing read from the tensors' values."""
    return (query.dtype in HALF and query.shape[-2] == 1 and query.device.type == "cpu" and not dropout
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
            and key.numel() * 4 <= MAX_COPY_BYTES)


def _widened(t):
    return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def decode_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, *args, **kwargs):
    """transformers' "sdpa" attention function, in float32 for a marked module's decode step (the module
    docstring); any other call goes to the wrapped function unchanged."""
    inner = _WRAPPED["sdpa"]
    dropout = kwargs.get("dropout", args[0] if args else 0.0)
    if not getattr(module, MARK, False) or not takes(query, key, dropout):
        return inner(module, query, key, value, attention_mask, *args, **kwargs)
    if "position_bias" in kwargs:
        kwargs["position_bias"] = _widened(kwargs["position_bias"])
    out, weights = inner(module, query.float(), key.float(), value.float(), _widened(attention_mask), *args, **kwargs)
    return out.to(query.dtype), weights


def install() -> None:
    """Wrap the "sdpa" entry of transformers' `AttentionInterface` with `decode_sdpa`, once per process (a later
    registration of "sdpa" by the user replaces it, and marked modules then run theirs)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    with _LOCK:
        current = ALL_ATTENTION_FUNCTIONS.get("sdpa")
        if current is decode_sdpa or current is None:
            return
        _WRAPPED["sdpa"] = current
        AttentionInterface.register("sdpa", decode_sdpa)


def adopt_decode_attention(model: nn.Module) -> list[str]:
    """Mark every module of `model` that dispatches on transformers' `AttentionInterface` (the module docstring);
    returns their names. Nothing happens to a model without one (transformers is not imported for it)."""
    names = [name for name, m in model.named_modules() if uses_attention_interface(m)]
    if names:
        install()
        for name in names:
            model.get_submodule(name).__dict__[MARK] = True
    return names


__all__ = ["MARK", "MAX_COPY_BYTES", "adopt_decode_attention", "decode_sdpa", "install", "takes",
           "uses_attention_interface"]
