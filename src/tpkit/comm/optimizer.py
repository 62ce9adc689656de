"""`CommunicationOptimizer` (the seed's name) and `instrument`: profiler + algorithm selection + pinned
staging around any Communicator, in the one order that works.

Order matters: the profiler is outermost, so it sees the algorithm each call ran; the algorithm layer is
next; staging is innermost, so algorithms and the builtin both get tensors on the backend's device.
Staging moves a tensor the backend cannot take directly (a CPU tensor on nccl, a CUDA tensor on gloo)
through a `PinnedBufferPool` buffer and returns the result on the caller's device.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .algorithm_communicator import AlgorithmCommunicator
from .communicator import Communicator
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
    """Move tensors the backend cannot take to its device through pinned buffers, and the result back."""

    def __init__(self, inner: Communicator, pool: PinnedBufferPool | None = None):
        super().__init__(inner)
        self.pool = pool if pool is not None else PinnedBufferPool()
        backend = getattr(inner, "torch_backend", None)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def _rewrap(self, group: Communicator) -> Communicator:
        return StagingCommunicator(group, self.pool)

    def _run(self, tensor, call):
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == self.device.type:
            return call(tensor)
        out = call(staged_copy(tensor, self.device, self.pool))
        return staged_copy(out, tensor.device, self.pool) if tensor.device.type == "cpu" else out.to(tensor.device)

    def all_reduce(self, tensor, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False):
        if async_op:
            return self.inner.all_reduce(tensor, op=op, async_op=True)
        return self._run(tensor, lambda t: self.inner.all_reduce(t, op=op))

    def all_gather(self, tensor, dim: int = 0, sizes: Sequence[int] | None = None, async_op: bool = False):
        if async_op:
            return self.inner.all_gather(tensor, dim=dim, sizes=sizes, async_op=True)
        return self._run(tensor, lambda t: self.inner.all_gather(t, dim=dim, sizes=sizes))

    def reduce_scatter(self, tensor, op: ReduceOp | str = ReduceOp.SUM, dim: int = 0,
                       sizes: Sequence[int] | None = None, async_op: bool = False):
        if async_op:
            return self.inner.reduce_scatter(tensor, op=op, dim=dim, sizes=sizes, async_op=True)
        return self._run(tensor, lambda t: self.inner.reduce_scatter(t, op=op, dim=dim, sizes=sizes))

    def broadcast(self, tensor, src: int = 0, async_op: bool = False):
        if async_op:
            return self.inner.broadcast(tensor, src=src, async_op=True)
        return self._run(tensor, lambda t: self.inner.broadcast(t, src=src))


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
