"""`ShapeCommunicator`: a communicator that moves no data, for running a converted model on the meta device.

It stands for rank `rank` of `world_size` ranks: every collective returns a tensor of the shape (and dtype and
device) the real one would return on that rank, filled with zeros (on the meta device, no values at all).
The converter's dry run (`tpkit.convert.dryrun`) runs a converted copy of a model through it, so shapes that
depend on the world size (local head counts, split features, uneven splits) are the real ones; the estimator's
traced activations and op counts (`tpkit.estimate.traced`, `estimate.ops`) convert a weightless copy for one rank
with it. Zeros rather than uninitialised memory: a dry run on a real copy computes on what comes back. Nothing
else may use it: no other rank exists to talk to.
"""
from __future__ import annotations

import torch

from ..layout import split_sizes
from .all_to_all import output_shape
from .communicator import Communicator
from .handle import Handle


class ShapeCommunicator(Communicator):
    """Rank `rank` of `world_size` ranks, for shapes only: results are shaped right and hold no data."""

    backend = "shapes"

    def __init__(self, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"ShapeCommunicator: rank {rank} outside world size {world_size}")
        super().__init__(rank, world_size, f"shapes{world_size}", timeout=1.0)

    def _all_reduce(self, tensor, op, async_op):
        return Handle.completed(torch.zeros_like(tensor))

    def _all_reduce_(self, tensor, op):
        return tensor

    def _all_gather(self, tensor, dim, sizes, async_op):
        shape = list(tensor.shape)
        shape[dim] = sum(sizes) if sizes is not None else shape[dim] * self.world_size
        return Handle.completed(tensor.new_zeros(shape))

    def _all_to_all(self, tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes, async_op):
        shape = output_shape(tensor.shape, scatter_dim, gather_dim, scatter_sizes, gather_sizes, self.rank)
        return Handle.completed(tensor.new_zeros(shape))

    def _reduce_scatter(self, tensor, op, dim, sizes, async_op):
        sizes = sizes or split_sizes(tensor.shape[dim], self.world_size)
        shape = list(tensor.shape)
        shape[dim] = sizes[self.rank]
        return Handle.completed(tensor.new_zeros(shape))

    def _broadcast(self, tensor, src, async_op):
        return Handle.completed(torch.zeros_like(tensor))

    def _barrier(self):
        return None

    def _send(self, tensor, dst):
        return None

    def _recv(self, tensor, src):
        return tensor

    def _new_group(self, members):
        if self.rank not in members:
            return None
        return ShapeCommunicator(members.index(self.rank), len(members))
