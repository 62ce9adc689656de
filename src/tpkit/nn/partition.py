"""How a full tensor is cut into per-rank shards, and how a shard says where it came from.

The split rule is `tpkit.comm.split_sizes` (the first ranks take the remainder, like `torch.tensor_split`);
every layer, mapping and checkpoint reader goes through `partition_sizes` / `shard` here so shards always
line up. A `chunk` is a unit that must not be cut (a head of `head_dim` rows, a group of query heads per
KV head): the dimension is split into whole chunks, the first ranks taking the spare ones.

What a rank holds is said by the layer (`PARTITION_DIMS`, `partition_sizes`, `partition_index`) and, for a
converted model, by its record (`record.py`: a `ShardLayout` per state-dict key); never by attributes on the
Parameter objects, which `load_state_dict(assign=True)`, `to_empty` or FSDP2 replace.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..layout import split_sizes


def partition_sizes(size: int, world_size: int, chunk: int = 1, *, layer: str = "layer", what: str = "size",
                    even: bool = False) -> list[int]:
    """Every rank's share of a dimension of `size` cut into whole `chunk`s over `world_size` ranks.

    `even=True` asks every rank to get the same number of chunks. Raises ValueError, naming the layer, the
    dimension, the size, the world size and the world sizes that would work, when the size is not a whole
    number of chunks or when the chunks cannot be shared out as asked.
    """
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"{layer}: chunk must be a positive int, got {chunk!r}")
    if size % chunk:
        raise ValueError(f"{layer}: {what} {size} is not a whole number of chunks of {chunk}; the size must be a "
                         f"multiple of {chunk}")
    units = size // chunk
    if even and units % world_size:
        valid = [w for w in range(1, units + 1) if units % w == 0]
        raise ValueError(f"{layer}: {what} {size} ({units} chunks of {chunk}) cannot be split evenly over "
                         f"world size {world_size}; valid world sizes: {valid}")
    if units < world_size:
        pieces = f"{units} chunks of {chunk}" if chunk > 1 else f"{units} rows/columns"
        raise ValueError(f"{layer}: {what} {size} has only {pieces}, fewer than world size {world_size}, so some "
                         f"rank would hold nothing; valid world sizes: 1..{units}")
    return [n * chunk for n in split_sizes(units, world_size)]


def shard(tensor: torch.Tensor, dim: int, sizes: Sequence[int], rank: int) -> torch.Tensor:
    """`rank`'s piece of the full `tensor` along `dim` (a view), for per-rank `sizes`."""
    if tensor.shape[dim] != sum(sizes):
        raise ValueError(f"shard: tensor of shape {tuple(tensor.shape)} has size {tensor.shape[dim]} in dim {dim}, "
                         f"but the shard sizes {list(sizes)} add up to {sum(sizes)}")
    start = sum(sizes[:rank])
    return tensor.narrow(dim, start, sizes[rank])
