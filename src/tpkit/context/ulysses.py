"""All-to-all attention (DeepSpeed Ulysses): trade the sequence split for a head split around the kernel.

Before the kernel, one all-to-all per tensor turns [batch, heads, local tokens, dim] on each rank into
[batch, heads / cp, every token, dim]; the model's own kernel (sdpa or eager) then runs on whole sequences of its
heads, and one all-to-all turns the output back. The gathered tokens arrive in rank order (zigzag chunks), so they
are put in natural order first: the kernel then sees an ordinary causal sequence and takes its `is_causal` path
(no mask in memory) unless padding or packed documents need one.

Heads must divide by cp. K/V heads either divide by cp too (each rank gets the K/V heads of its query heads) or
are fewer than cp with cp a multiple of them: each K/V head is then repeated cp / kv_heads times before the
all-to-all, so every rank receives the one K/V head its query heads read (DeepSpeed's rule). Otherwise `auto`
takes the ring (`ring.py`), which splits no heads.
"""
from __future__ import annotations

import torch

from ..comm.communicator import Communicator
from ..nn.mappings import all_to_all
from .batch import ContextBatch


def heads_fit(heads: int, kv_heads: int, cp: int) -> str | None:
    """Why all-to-all cannot split these local heads over cp, or None when it can."""
    if heads % cp:
        return f"{heads} local query heads do not divide by cp {cp}"
    if kv_heads % cp and cp % kv_heads:
        return f"{kv_heads} local K/V heads neither divide by cp {cp} nor divide it"
    return None


class _Kernel:
    """The attention module as the kernel reads it, with the query groups per K/V head of the head split."""

    def __init__(self, module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def ulysses_attention(module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                      batch: ContextBatch, kernel, kernel_name: str, window: int | None = None,
                      **kwargs) -> torch.Tensor:
    """This rank's attention output [batch, local tokens, heads, dim] (the layout HF kernels return)."""
    cp = comm.world_size
    if k.shape[1] < cp and k.shape[1] % cp:
        k, v = (t.repeat_interleave(cp // t.shape[1], dim=1) for t in (k, v))
    split = batch.split
    natural = split.natural(q.device)
    q, k, v = (all_to_all(t, comm, scatter_dim=1, gather_dim=2).index_select(2, natural) for t in (q, k, v))
    mask = None
    if batch.masked or window is not None or kernel_name == "eager":  # eager applies no causal mask of its own
        positions = torch.arange(split.padded, device=q.device)
        allowed = batch.allowed(positions, positions, window)
        mask = allowed if kernel_name != "eager" else \
            torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, torch.finfo(q.dtype).min)
    out, _ = kernel(_Kernel(module, q.shape[1] // k.shape[1]), q, k, v, mask, **kwargs)
    out = out.index_select(1, split.order(q.device))  # [batch, tokens in rank order, heads / cp, dim]
    return all_to_all(out, comm, scatter_dim=1, gather_dim=2)
