"""How a full tensor is cut into per-rank shards, and how a shard says where it came from.

The split rule is `tpkit.comm.split_sizes` (the first ranks take the remainder, like `torch.tensor_split`);
every layer, mapping and checkpoint reader goes through `partition_sizes` / `shard` here so shards always
line up. A `chunk` is a unit that must not be cut (a head of `head_dim` rows, a group of query heads per
KV head): the dimension is split into whole chunks, the first ranks taking the spare ones.

Marking (what the converter, the checkpoint code and `clip_grad_norm_` rely on), set on each Parameter:

- ``param.tensor_model_parallel``: True when the parameter is a shard of a bigger tensor, False (or
  absent) when every rank holds the whole tensor (replicated).
- ``param.partition_dim``: the dimension of the full tensor that was cut (0 for a ColumnParallelLinear
  weight, 1 for a RowParallelLinear weight, ...).
- ``param.partition_sizes``: tuple of every rank's size along `partition_dim` (their sum is the full size;
  this rank's start is the sum of the sizes before it).
- ``param.partition_stride``: always 1 (kept for readers of Megatron checkpoints).
- ``param.partition_replicas`` (optional): when some slices along `partition_dim` live on several ranks (KV
  heads replicated because there are fewer KV heads than ranks), a tuple with, for each of this rank's
  slices, the number of ranks holding it. `clip_grad_norm_` divides those slices' contribution by it so the
  norm counts every element of the full tensor once.
- ``param.sequence_parallel``: True on replicated parameters whose gradient is a partial sum under
  sequence parallelism (LayerNorm/RMSNorm weights, a RowParallelLinear bias); see `sequence_parallel.py`.

Layers also expose the same facts without the Parameter objects (which `load_state_dict(assign=True)` or
`to_empty` may replace): `layer.partition_sizes` and the class mapping `layer.PARTITION_DIMS`
(parameter name -> dim, or None for replicated).
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


def mark_tensor_parallel(param: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Record on `param` that it is one rank's shard along `dim` of a tensor split as `sizes`."""
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = dim  # type: ignore[attr-defined]
    param.partition_sizes = tuple(int(s) for s in sizes)  # type: ignore[attr-defined]
    param.partition_stride = 1  # type: ignore[attr-defined]
    return param


def mark_replicated(param: torch.Tensor) -> torch.Tensor:
    """Record on `param` that every rank holds all of it."""
    param.tensor_model_parallel = False  # type: ignore[attr-defined]
    return param


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True when `param` is a shard (marked by a tpkit layer), False when it is replicated or unmarked."""
    return bool(getattr(param, "tensor_model_parallel", False))
