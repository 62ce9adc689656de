"""Caches as a model's own modules leave them, for the framework terms (`framework.py`).

Why: a decoder layer's Python and dispatch cost what they cost when the CPU's caches hold them, and between the
modules of a real model they do not: each module first streams its weights (megabytes) through those caches. On
the 2-core box (4 MiB of L2 per core) one decoder layer's framework time in `generate` at a batch of 8 was
0.26-0.32 ms on a tiny model that fits in the caches, and 0.74-0.75 ms with 8 MiB read before each layer and its
MLP, as a layer of a model at hidden 384 reads its weights; batched decoding of such models came out 21-35% fast
without it. So the calibration reads `FLUSH_BYTES` before each decoder layer, MLP and LM head of its tiny models
and leaves the time of those reads out of what it measures.
"""
from __future__ import annotations

import re
import time

import torch
from torch import nn

__all__ = ["CacheFlush", "FLUSH_BYTES", "flush_between_modules"]

FLUSH_BYTES = 8 << 20  # more than a server core's private caches (1-4 MiB), as one layer's weights of a real model
_MODULES = re.compile(r"(^|\.)(layers|h)\.\d+$|(^|\.)(mlp|lm_head)$")  # decoder layers, their MLPs, the LM head


class CacheFlush:
    """A forward pre-hook that reads `nbytes` (evicting what the caches held) and keeps the seconds it took in
    `spent`, so a timing can leave them out."""

    def __init__(self, nbytes: int = FLUSH_BYTES):
        self.buffer = torch.ones(max(1, nbytes // 4))
        self.spent = 0.0

    def __call__(self, module: nn.Module, args) -> None:
        start = time.perf_counter()
        self.buffer.sum()
        self.spent += time.perf_counter() - start


def flush_between_modules(model: nn.Module, flush: CacheFlush) -> list:
    """`flush` before each decoder layer, MLP and LM head of a transformers `model` (also inside DDP's `.module`);
    the hook handles."""
    return [m.register_forward_pre_hook(flush) for name, m in model.named_modules() if _MODULES.search(name)]
