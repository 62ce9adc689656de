"""What every tensor-parallel layer shares: finding its communicator, building its shards, checking input.

Construction from sizes builds the full PyTorch module on the CPU under the current RNG state and keeps this
rank's slice, so a model built from tpkit layers consumes the RNG exactly as the single-device model does and
TP=1 and TP=N start from the same numbers. On `device="meta"` nothing is initialised (shapes only).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from ..comm.communicator import Communicator
from .partition import shard
from .record import SplitsParameters


class TensorParallelModule(SplitsParameters, nn.Module):
    """Base of every tpkit layer: holds the communicator its collectives run on (`comm`, `world_size`, `rank`)
    and says which of its parameters are split (`PARTITION_DIMS`: name -> dim of the local tensor, None for whole).

    `copy.deepcopy` of a layer shares the communicator, and pickling it refers to the communicator as "rank r of
    group g" and binds the live one on unpickling (`tpkit.comm.rebind`): a communicator is a connection to the
    other ranks, not data.
    """

    PARTITION_DIMS: dict[str, int | None] = {}
    comm: Communicator

    def _set_comm(self, comm: Communicator | None) -> None:
        self.comm = resolve_comm(comm)
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        self._declare_split()

    def split_dims(self) -> dict[str, int]:
        return {n: d for n, d in self.PARTITION_DIMS.items() if d is not None and self.world_size > 1}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._declare_split()


def resolve_comm(comm: Communicator | None) -> Communicator:
    """`comm`, or the default communicator of this process / thread-rank (`tpkit.get_communicator()`)."""
    if comm is not None:
        return comm
    from ..distributed import get_communicator

    return get_communicator()


def check_positive(layer: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{layer}: {name} must be a positive int, got {value!r}")


def is_meta(device) -> bool:
    return device is not None and torch.device(device).type == "meta"


def full_module(factory: Callable[..., nn.Module], device, dtype) -> nn.Module:
    """The full module as one device would initialise it (CPU, current RNG), or shapes only on meta."""
    if is_meta(device):
        return factory(device="meta", dtype=dtype)
    return factory(device="cpu", dtype=dtype)


def make_shard(full: torch.Tensor | None, dim: int | None, sizes: Sequence[int], rank: int, *, device=None,
               dtype=None, requires_grad: bool = True, index: Sequence[int] | None = None) -> nn.Parameter | None:
    """A Parameter holding `rank`'s slice of `full` along `dim` (or all of it when `dim` is None).

    `index` picks explicit positions along `dim` instead of the contiguous slice (whole heads spread over the
    ranks, a KV head several ranks hold, pieces of a packed projection). The slice is copied so the full tensor can
    be freed, except at world size 1 (one entry in `sizes`) with the same device and dtype, where the layer simply
    holds the full module's own tensor. Nothing is set on the Parameter: what it holds is the layer's fact
    (`PARTITION_DIMS`, `partition_sizes`, `partition_index`) and the model record's (`record.py`).
    """
    if full is None:
        return None
    if dim is None:
        piece = full.detach()
    elif index is not None:
        piece = full.detach().index_select(dim, torch.tensor(list(index), dtype=torch.long, device=full.device))
    else:
        piece = shard(full.detach(), dim, sizes, rank)
    target_device = piece.device if device is None else torch.device(device)
    target_dtype = piece.dtype if dtype is None else dtype
    if not (len(sizes) == 1 and piece.device == target_device and piece.dtype == target_dtype):
        piece = piece.to(device=target_device, dtype=target_dtype, copy=True, memory_format=torch.contiguous_format)
    return nn.Parameter(piece, requires_grad=requires_grad)


def check_index(layer: str, what: str, full_size: int, index: Sequence[int], sizes: Sequence[int], rank: int,
                world_size: int) -> tuple[list[int], list[int]]:
    """Validate an explicit shard index and the per-rank sizes that go with it, before anything is built."""
    index, sizes = [int(i) for i in index], [int(s) for s in sizes]
    if len(sizes) != world_size:
        raise ValueError(f"{layer}: partition_sizes {sizes} must have one entry per rank ({world_size})")
    if len(index) != sizes[rank]:
        raise ValueError(f"{layer}: index picks {len(index)} of the {full_size} {what} but partition_sizes gives "
                         f"rank {rank} {sizes[rank]}")
    bad = [i for i in index if not 0 <= i < full_size]
    if bad:
        raise ValueError(f"{layer}: index entries {bad[:5]} are outside the {full_size} {what} (0..{full_size - 1})")
    return index, sizes


def check_module(layer: str, module: nn.Module, expected: type, unsupported: dict[str, object]) -> None:
    """Reject modules `from_module` cannot shard exactly, before anything is built."""
    if not isinstance(module, expected):
        raise TypeError(f"{layer}.from_module: expected a torch.nn.{expected.__name__}, got {type(module).__name__}")
    for attr, default in unsupported.items():
        value = getattr(module, attr, default)
        if value != default:
            raise ValueError(f"{layer}.from_module: {attr}={value!r} is not supported (only {attr}={default!r})")


def check_last_dim(layer: str, x: torch.Tensor, expected: int, what: str) -> None:
    if x.dim() == 0 or x.shape[-1] != expected:
        raise ValueError(f"{layer}: input of shape {tuple(x.shape)} should have {expected} {what} in its last dim")


def check_sequence_divisible(layer: str, x: torch.Tensor, dim: int, world_size: int) -> None:
    """Sequence parallelism keeps equal sequence shards, so the gathers need no size exchange."""
    length = x.shape[dim]
    if length % world_size:
        raise ValueError(f"{layer}: sequence parallelism needs the sequence length (dim {dim} of input shape "
                         f"{tuple(x.shape)}: {length}) to be a multiple of the world size {world_size}; pad the "
                         f"sequence to a multiple of {world_size}")
