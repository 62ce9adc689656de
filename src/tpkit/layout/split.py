"""The split rule: how a size that does not divide by the world size is cut into per-rank pieces.

tpkit follows `torch.tensor_split`: with `size = q * world + r`, ranks `0 .. r-1` get `q + 1` and the rest
get `q`. Every layer, collective and checkpoint reader uses these two functions, so shards always line up.
"""
from __future__ import annotations


def split_sizes(size: int, world_size: int) -> list[int]:
    """Per-rank sizes of a dimension of `size` cut over `world_size` ranks (first ranks take the remainder)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    base, extra = divmod(size, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def split_range(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """The half-open range `[start, end)` of `rank`'s piece of a dimension of `size`."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    sizes = split_sizes(size, world_size)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]
