"""broadcast algorithms: binomial tree (short messages) and van de Geijn's scatter + all-gather (long)."""
from __future__ import annotations

import torch

from ..communicator import Communicator
from ...layout import split_sizes
from .point_to_point import PointToPoint
from .steps import offsets, ring_all_gather_flat


def _root_copy_or_buffer(tensor: torch.Tensor, is_root: bool) -> torch.Tensor:
    """The root's own copy of its tensor; an empty buffer of the same shape on the other ranks."""
    if is_root:
        return tensor.detach().contiguous().clone()
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def binomial_broadcast(comm: Communicator, tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Binomial tree from `src`: ceil(log2 n) steps of the whole vector (MPICH's short-message choice)."""
    p2p = PointToPoint(comm)
    n, vr = p2p.world_size, (p2p.rank - src) % p2p.world_size
    out = _root_copy_or_buffer(tensor, vr == 0)
    flat, mask = out.reshape(-1), 1
    while mask < n:
        if vr & mask:
            p2p.recv(flat, (vr - mask + src) % n)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < n:
            p2p.send(flat, (vr + mask + src) % n)
        mask >>= 1
    return out


def scatter_allgather_broadcast(comm: Communicator, tensor: torch.Tensor, src: int) -> torch.Tensor:
    """van de Geijn: binomial scatter of n chunks, then ring all-gather; ~2x one copy's bytes, for long messages."""
    p2p = PointToPoint(comm)
    n, vr = p2p.world_size, (p2p.rank - src) % p2p.world_size
    out = _root_copy_or_buffer(tensor, vr == 0)
    flat = out.reshape(-1)
    off = offsets(split_sizes(flat.numel(), n))  # chunk i belongs to relative rank i
    real = lambda v: (v + src) % n  # noqa: E731
    mask = 1
    while mask < n:  # receive my subtree's chunks [vr, vr + lowbit(vr)) from my parent
        if vr & mask:
            p2p.recv(flat[off[vr]:off[min(vr + mask, n)]], real(vr - mask))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < n:
            p2p.send(flat[off[vr + mask]:off[min(vr + 2 * mask, n)]], real(vr + mask))
        mask >>= 1
    ring_all_gather_flat(p2p, flat, [off[i + 1] - off[i] for i in range(n)], [real(v) for v in range(n)])
    return out
