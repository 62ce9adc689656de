"""`CommunicationOptimizer` (the seed's name) and `instrument`: profiler + algorithm selection + pinned
staging around any Communicator, in the one order that works.

Order matters: the profiler is outermost, so it sees the algorithm each call ran; the algorithm layer is
next; staging is innermost, so algorithms and the builtin both get tensors on the backend's device.
Staging moves a tensor the backend cannot take directly (a CPU tensor on nccl, a CUDA tensor on gloo)
through a `PinnedBufferPool` buffer and returns the result on the caller's device, synchronous and
`async_op=True` calls alike (an async call's input is staged when it is issued, its result when it is
waited for).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .algorithm_communicator import AlgorithmCommunicator
from .communicator import Communicator
from .handle import Handle
from .ops import ReduceOp
from .pinned import PinnedBufferPool, staged_copy
from .profiler import CommProfiler
from .selector import AlgorithmSelector
from .wrapper import WrappedCommunicator


def instrument(comm: Communicator, profile: bool = False,
               algorithm: "str | Mapping[str, str] | None" = None) -> Communicator:
    """`comm`, wrapped for `algorithm=` (AlgorithmCommunicator) and then `profile=True` (CommProfiler).

    With neither option it returns `comm` itself, so callers can pass their options through unconditionally.
    """
    if algorithm is not None and algorithm != "builtin":
        comm = AlgorithmCommunicator(comm, algorithm)
    if profile:
        comm = CommProfiler(comm)
    return comm


class StagingCommunicator(WrappedCommunicator):
    """Move tensors the backend cannot take to its device through pinned buffers, and the result back.

    `close()` also drops the pool's free buffers when this communicator made the pool."""

    def __init__(self, inner: Communicator, pool: PinnedBufferPool | None = None):
        super().__init__(inner)
        self._owns_pool = pool is None
        self.pool = pool if pool is not None else PinnedBufferPool()
        backend = getattr(inner, "torch_backend", None)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def _rewrap(self, group: Communicator) -> Communicator:
        return StagingCommunicator(group, self.pool)

    def _close(self) -> None:
        super()._close()
        if self._owns_pool:
            self.pool.clear()

    def needs_staging(self, tensor) -> bool:
        """Whether `tensor` must be copied to the backend's device first (it lives on another kind of device)."""
        return isinstance(tensor, torch.Tensor) and tensor.device.type != self.device.type

    def _back(self, out: torch.Tensor, device: torch.device) -> torch.Tensor:
        return staged_copy(out, device, self.pool) if device.type == "cpu" else out.to(device)

    def _run(self, tensor, call, async_op: bool):
        if not self.needs_staging(tensor):
            return call(tensor, async_op)
        out = call(staged_copy(tensor, self.device, self.pool), async_op)
        if not async_op:
            return self._back(out, tensor.device)
        return Handle(lambda: self._back(out.wait(), tensor.device), out.is_completed)

    def all_reduce(self, tensor, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False):
        return self._run(tensor, lambda t, a: self.inner.all_reduce(t, op=op, async_op=a), async_op)

    def all_gather(self, tensor, dim: int = 0, sizes: Sequence[int] | None = None, async_op: bool = False):
        return self._run(tensor, lambda t, a: self.inner.all_gather(t, dim=dim, sizes=sizes, async_op=a), async_op)

    def all_to_all(self, tensor, scatter_dim: int, gather_dim: int, scatter_sizes: Sequence[int] | None = None,
                   gather_sizes: Sequence[int] | None = None, async_op: bool = False):
        return self._run(tensor, lambda t, a: self.inner.all_to_all(t, scatter_dim, gather_dim, scatter_sizes,
                                                                    gather_sizes, async_op=a), async_op)

    def reduce_scatter(self, tensor, op: ReduceOp | str = ReduceOp.SUM, dim: int = 0,
                       sizes: Sequence[int] | None = None, async_op: bool = False):
        return self._run(tensor, lambda t, a: self.inner.reduce_scatter(t, op=op, dim=dim, sizes=sizes, async_op=a),
                         async_op)

    def broadcast(self, tensor, src: int = 0, async_op: bool = False):
        return self._run(tensor, lambda t, a: self.inner.broadcast(t, src=src, async_op=a), async_op)


class CommunicationOptimizer(CommProfiler):
    """The whole toolkit around `comm`: profiled (`records`, `stats()`, traces), algorithms chosen by
    `selector` (`algorithm="auto"` by default; `calibrate()` to fit the cost model on this group), and
    device mismatches staged through `pool`."""

    def __init__(self, comm: Communicator, algorithm: "str | Mapping[str, str]" = "auto",
                 selector: AlgorithmSelector | None = None, pool: PinnedBufferPool | None = None,
                 profile: bool = True):
        self.staging = StagingCommunicator(comm, pool)
        self.algorithms = AlgorithmCommunicator(self.staging, algorithm, selector)
        super().__init__(self.algorithms, enabled=profile)

    @property
    def selector(self) -> AlgorithmSelector:
        return self.algorithms.selector

    @property
    def pool(self) -> PinnedBufferPool:
        return self.staging.pool

    def calibrate(self, **kwargs) -> "CommunicationOptimizer":
        """Fit the cost model on this group (collective: every rank calls it)."""
        self.algorithms.calibrate(**kwargs)
        return self

    def new_group(self, ranks: Sequence[int]) -> "Communicator | None":
        group = self.staging.inner.new_group(ranks)
        if group is None:
            return None
        sub = CommunicationOptimizer(group, self.algorithms.algorithm, self.selector, self.pool, self.enabled)
        sub._root = self._root  # one profile for the whole job
        return sub
