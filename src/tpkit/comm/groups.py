"""Laying ranks out as data parallel x tensor parallel groups."""
from __future__ import annotations

from .communicator import Communicator


def split(comm: Communicator, tp_size: int) -> tuple[Communicator, Communicator]:
    """Cut `comm` into tensor-parallel groups of `tp_size` consecutive ranks and the data-parallel groups
    across them; return this rank's `(tp_group, dp_group)`.

    Ranks 0..3 with tp_size 2: tp groups {0,1} {2,3}; dp groups {0,2} {1,3}. Consecutive ranks share a
    tensor-parallel group because they usually share a node, where the bandwidth is. Collective over `comm`.
    """
    n = comm.world_size
    if not isinstance(tp_size, int) or tp_size < 1 or n % tp_size:
        valid = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(f"split: tp_size {tp_size!r} does not divide the world size {n}; valid tp sizes: {valid}")
    tp_group = dp_group = None
    for start in range(0, n, tp_size):
        group = comm.new_group(range(start, start + tp_size))
        tp_group = group if group is not None else tp_group
    for offset in range(tp_size):
        group = comm.new_group(range(offset, n, tp_size))
        dp_group = group if group is not None else dp_group
    assert tp_group is not None and dp_group is not None
    return tp_group, dp_group
