"""A few integers that change with any bit of a tensor: how ranks compare what they hold without sending it.

`digest(t)` reads the tensor's bytes as integers and returns `[present, sum, sum of squares]` (int64, wrapping) on
the tensor's device: no copy to the host, no host sync, and in chunks, so a large tensor never needs an int64 copy
of itself. The replica sentinel (`tpkit.check_replicas`) and the forward sentinel (`sentinel.py`) all-gather such
digests and compare them.
"""
from __future__ import annotations

import torch

_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 20  # elements per int64 chunk


def digest(t: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Three int64s on `device` that change with any bit of `t`: a present flag, the sum and the sum of squares of its
    bytes read as integers (wrapping); zeros for a missing tensor."""
    if t is None:
        return torch.zeros(3, dtype=torch.int64, device=device)
    w = t.detach().contiguous().reshape(-1)
    w = w.view(_WORDS[w.element_size()]) if w.numel() else w.new_zeros(0, dtype=torch.int64)
    total = torch.zeros(2, dtype=torch.int64, device=w.device)
    for start in range(0, w.numel(), _CHUNK):
        part = w[start:start + _CHUNK].to(torch.int64)
        total += torch.stack((part.sum(), (part * part).sum()))
    return torch.cat((torch.ones(1, dtype=torch.int64, device=w.device), total))
