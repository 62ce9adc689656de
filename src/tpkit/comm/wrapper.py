"""`WrappedCommunicator`: a Communicator that forwards everything to another one.

The profiler, the algorithm selector and the optimizer are layers around a backend communicator. Making
each a `Communicator` (not a look-alike) lets every TP layer, `split`, `new_group` and `launch` use them
unchanged; subclasses override only the collectives they add something to.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .communicator import Communicator
from .handle import Handle
from .ops import ReduceOp
from .rebind import root_of


class WrappedCommunicator(Communicator):
    """Forward every call to `inner`; `new_group` wraps the subgroup the same way (`_rewrap`)."""

    def __init__(self, inner: Communicator):
        if not isinstance(inner, Communicator):
            raise TypeError(f"{type(self).__name__}: expected a tpkit Communicator to wrap, got {type(inner).__name__}")
        super().__init__(inner.rank, inner.world_size, inner.name, inner.timeout)
        self.inner = inner

    @property
    def backend(self) -> str:  # type: ignore[override]
        return self.inner.backend

    def __getattr__(self, name: str):
        # Backend extras (process_group, torch_backend, ...) stay reachable through any number of wrappers.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def base(self) -> Communicator:
        """The backend communicator under all wrappers."""
        comm = self.inner
        while isinstance(comm, WrappedCommunicator):
            comm = comm.inner
        return comm

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    # -- forwarding -------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False):
        return self.inner.all_reduce(tensor, op=op, async_op=async_op)

    def all_reduce_(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM) -> torch.Tensor:
        # Through this wrapper's all_reduce, so what the wrapper adds (profiling, algorithms) sees it too.
        result = self.all_reduce(tensor, op=op)
        with torch.no_grad():
            return tensor.copy_(result)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None,
                   async_op: bool = False):
        return self.inner.all_gather(tensor, dim=dim, sizes=sizes, async_op=async_op)

    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int,
                   scatter_sizes: Sequence[int] | None = None, gather_sizes: Sequence[int] | None = None,
                   async_op: bool = False):
        return self.inner.all_to_all(tensor, scatter_dim, gather_dim, scatter_sizes=scatter_sizes,
                                     gather_sizes=gather_sizes, async_op=async_op)

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, dim: int = 0,
                       sizes: Sequence[int] | None = None, async_op: bool = False):
        return self.inner.reduce_scatter(tensor, op=op, dim=dim, sizes=sizes, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        return self.inner.broadcast(tensor, src=src, async_op=async_op)

    def barrier(self, async_op: bool = False) -> Handle | None:
        return self.inner.barrier(async_op=async_op)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.inner.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.inner.recv(tensor, src)

    def new_group(self, ranks: Sequence[int]) -> "Communicator | None":
        group = self.inner.new_group(ranks)
        if group is None:
            return None
        wrapped = self._rewrap(group)
        wrapped.__dict__["_root"] = root_of(self)  # (rebind.py) a group of this wrapped world, as its inner one is
        return wrapped

    def _rewrap(self, group: Communicator) -> Communicator:
        """The same kind of wrapper around a subgroup; subclasses with settings override this."""
        return type(self)(group)

    def _close(self) -> None:
        # A wrapper owns what it wraps: `with create_communicator(..., profile=True) as comm` must release the
        # backend's group, not just the profiler.
        self.inner.close()

    # -- primitives: never reached, the public methods above forward first -------------------------
    def _all_reduce(self, tensor, op, async_op) -> Handle:
        return Handle.completed(self.inner.all_reduce(tensor, op=op))

    def _all_gather(self, tensor, dim, sizes, async_op) -> Handle:
        return Handle.completed(self.inner.all_gather(tensor, dim=dim, sizes=sizes))

    def _all_to_all(self, tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes, async_op) -> Handle:
        return Handle.completed(self.inner.all_to_all(tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes))

    def _reduce_scatter(self, tensor, op, dim, sizes, async_op) -> Handle:
        return Handle.completed(self.inner.reduce_scatter(tensor, op=op, dim=dim, sizes=sizes))

    def _broadcast(self, tensor, src, async_op) -> Handle:
        return Handle.completed(self.inner.broadcast(tensor, src=src))

    def _barrier(self) -> None:
        self.inner.barrier()

    def _send(self, tensor, dst) -> None:
        self.inner.send(tensor, dst)

    def _recv(self, tensor, src):
        return self.inner.recv(tensor, src)

    def _new_group(self, members):
        return self.new_group(members)
