"""tpkit: tensor parallelism for PyTorch models that is exact, fast and boring.

Public API: process setup (`init`, `launch`, `get_communicator`, the seed-style helpers) and, through
`tpkit.comm`, the communication layer. See README.md for the tour.
"""
from __future__ import annotations

from .comm import CommError, Communicator, ReduceOp, create_communicator, run_threads
from .distributed import (
    TPConfig,
    all_reduce_sum,
    broadcast_tensor,
    get_communicator,
    get_tensor_parallel_config,
    init,
    init_tensor_parallel,
    set_communicator,
    shutdown,
    synchronize_across_ranks,
    use_communicator,
)
from .launch import LaunchError, launch

__version__ = "0.1.0"

__all__ = [
    "CommError", "Communicator", "LaunchError", "ReduceOp", "TPConfig", "__version__", "all_reduce_sum",
    "broadcast_tensor", "create_communicator", "get_communicator", "get_tensor_parallel_config", "init",
    "init_tensor_parallel", "launch", "run_threads", "set_communicator", "shutdown", "synchronize_across_ranks",
    "use_communicator",
]
