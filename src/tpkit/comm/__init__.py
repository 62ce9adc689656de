"""`tpkit.comm`: communication for tensor parallelism on every backend.

`Communicator` is the interface; `create_communicator(name)` picks a backend (`torch`, `threads`, `mpi`);
`split` lays out tensor x data parallel groups. The performance toolkit wraps any communicator:
`CommProfiler` (what each call cost), `AlgorithmCommunicator` + `AlgorithmSelector` + `CostModel`
(which algorithm runs), `PinnedBufferPool` (host staging), `CommunicationOptimizer` (all of them);
`topology()` describes the machine.
"""
from __future__ import annotations

from typing import Any, Callable

from .communicator import Communicator
from .context import current_thread_communicator, use_communicator
from .errors import CommError
from .groups import split
from .handle import Handle
from .ops import ReduceOp
from .sharding import split_range, split_sizes
from .threads import ThreadCommunicator, create_communicators, run_threads
from .algorithm_communicator import AlgorithmCommunicator
from .algorithms import ALGORITHMS
from .cost_model import CostModel
from .optimizer import CommunicationOptimizer, instrument
from .pinned import PinnedBuffer, PinnedBufferPool
from .profiler import CommProfiler, CommRecord
from .selector import AlgorithmSelector
from .topology import Topology, topology
from .wrapper import WrappedCommunicator


def _make_threads(world_size: int = 1, timeout: float | None = None, **config) -> Communicator:
    if config:
        raise ValueError(f"threads backend: unknown options {sorted(config)}")
    current = current_thread_communicator()
    if current is not None and current.backend == "threads":
        return current
    if world_size != 1:
        raise ValueError(f"threads backend: a single call cannot make {world_size} thread-ranks; use "
                         f"tpkit.comm.run_threads(fn, {world_size}) or create_communicators({world_size})")
    return create_communicators(1, timeout)[0]


def _make_torch(group=None, timeout: float | None = None, backend: str | None = None, **config) -> Communicator:
    if config:
        raise ValueError(f"torch backend: unknown options {sorted(config)}")
    import torch.distributed as dist

    from .torch_backend import TorchCommunicator

    if not dist.is_initialized():
        from ..distributed import init
        if group is not None:
            raise ValueError("torch backend: a group was given but torch.distributed is not initialised")
        return init(backend, timeout)
    return TorchCommunicator(group, timeout)


def _make_mpi(**config) -> Communicator:
    from .mpi import MPICommunicator

    return MPICommunicator(**config)


BACKENDS: dict[str, Callable[..., Communicator]] = {
    "torch": _make_torch,
    "threads": _make_threads,
    "mpi": _make_mpi,
}


def create_communicator(backend: str, algorithm: Any = None, profile: bool = False, **config: Any) -> Communicator:
    """A communicator of the named backend: `torch` (nccl/gloo/mpi process groups; `backend=` picks which
    when torch.distributed is not yet initialised), `threads`, or `mpi` (mpi4py).

    `algorithm="auto" | name | {collective: name}` runs collectives through `AlgorithmCommunicator`;
    `profile=True` records them in a `CommProfiler` (see `instrument`)."""
    factory = BACKENDS.get(str(backend).lower())
    if factory is None:
        raise ValueError(f"unknown communication backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    return instrument(factory(**config), profile=profile, algorithm=algorithm)


__all__ = [
    "ALGORITHMS", "AlgorithmCommunicator", "AlgorithmSelector", "CommProfiler", "CommRecord",
    "CommunicationOptimizer", "CostModel", "PinnedBuffer", "PinnedBufferPool", "Topology", "WrappedCommunicator",
    "instrument", "topology",
    "BACKENDS", "CommError", "Communicator", "Handle", "ReduceOp", "ThreadCommunicator", "create_communicator",
    "create_communicators", "run_threads", "split", "split_range", "split_sizes",
]
