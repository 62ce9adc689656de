"""A communicator of any world size that moves no data: every collective returns an uninitialised tensor of
the result's shape.

Why: the traced activation estimate converts a weightless copy of the model for one rank of t and runs its
forward on fake tensors. The converted layers call their collectives as on a real run; all that matters there
is the shape (and dtype, device) of each result, never its values, and no other rank exists to talk to.
Nothing else may use it: its results are garbage by design.
"""
from __future__ import annotations

import torch

from ..comm.communicator import Communicator
from ..comm.handle import Handle
from ..layout import split_sizes


class ShapeOnlyCommunicator(Communicator):
    """Rank `rank` of `world_size` with no peers: collectives return `empty` tensors of the right shape."""

    def __init__(self, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"ShapeOnlyCommunicator: rank {rank} outside world size {world_size}")
        super().__init__(rank, world_size, f"shape-only-{world_size}", 1.0)

    def _all_reduce(self, tensor, op, async_op):
        return Handle.completed(torch.empty_like(tensor))

    def _all_reduce_(self, tensor, op):
        return tensor

    def _all_gather(self, tensor, dim, sizes, async_op):
        shape = list(tensor.shape)
        shape[dim] = sum(sizes) if sizes else shape[dim] * self.world_size
        return Handle.completed(tensor.new_empty(shape))

    def _reduce_scatter(self, tensor, op, dim, sizes, async_op):
        shape = list(tensor.shape)
        shape[dim] = (sizes or split_sizes(shape[dim], self.world_size))[self.rank]
        return Handle.completed(tensor.new_empty(shape))

    def _broadcast(self, tensor, src, async_op):
        return Handle.completed(tensor)

    def _barrier(self) -> None:
        return None

    def _send(self, tensor, dst) -> None:
        return None

    def _recv(self, tensor, src):
        return tensor

    def _new_group(self, members):
        return ShapeOnlyCommunicator(members.index(self.rank) if self.rank in members else 0, len(members))
