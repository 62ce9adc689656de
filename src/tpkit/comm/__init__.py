"""`tpkit.comm`: communication for tensor parallelism on every backend.

`Communicator` is the interface; `create_communicator(name)` picks a backend (`torch`, `threads`, `mpi`);
`split` lays out tensor x data parallel groups, `groups` the pp x dp x cp x tp layout. The performance toolkit
wraps any communicator:
`CommProfiler` (what each call cost), `AlgorithmCommunicator` + `AlgorithmSelector` + `CostModel`
(which algorithm runs), `PinnedBufferPool` (host staging), `CommunicationOptimizer` (all of them);
`topology()` describes the machine, `probe_gpudirect()` its GPUDirect RDMA support. A communicator is a
context manager: `close()` releases its group.
"""
from __future__ import annotations

from .backends import BACKENDS, create_communicator
from .communicator import Communicator
from .context import current_thread_communicator, use_communicator
from .errors import CommError
from .rank_groups import Groups, groups, split
from .handle import Handle
from .ops import ReduceOp
from ..layout import split_range, split_sizes
from .threads import ThreadCommunicator, create_communicators, run_threads
from .algorithm_communicator import AlgorithmCommunicator
from .algorithms import ALGORITHMS
from .cost_model import CostModel
from .gpudirect import GPUDirect, probe_gpudirect
from .optimizer import CommunicationOptimizer, instrument
from .pinned import PinnedBuffer, PinnedBufferPool
from .profiler import CommProfiler, CommRecord, CommStats
from .selector import AlgorithmSelector
from .topology import Topology, topology
from .wrapper import WrappedCommunicator

__all__ = [
    "ALGORITHMS", "AlgorithmCommunicator", "AlgorithmSelector", "CommProfiler", "CommRecord", "CommStats",
    "CommunicationOptimizer", "CostModel", "GPUDirect", "PinnedBuffer", "PinnedBufferPool", "Topology",
    "WrappedCommunicator", "instrument", "probe_gpudirect", "topology",
    "BACKENDS", "CommError", "Communicator", "Handle", "ReduceOp", "ThreadCommunicator", "create_communicator",
    "create_communicators", "Groups", "groups", "run_threads", "split", "split_range", "split_sizes",
]
