"""tpkit: tensor parallelism for PyTorch models that is exact, fast and boring.

Public API: process setup (`init`, `launch`, `get_communicator`, the seed-style helpers), conversion
(`analyze`, `plan`, `parallelize`, `verify`, the estimates), and the subpackages `tpkit.comm` (communication)
and `tpkit.nn` (tensor-parallel layers). See README.md, and the documentation site in docs/ (`make docs`).
"""
from __future__ import annotations

from .comm import (AlgorithmSelector, CommError, CommProfiler, CommunicationOptimizer, Communicator, CostModel,
                   PinnedBufferPool, ReduceOp, create_communicator, run_threads, topology)
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
from . import comm, nn
from .nn import (ColumnParallelConv2d, ColumnParallelLinear, ParallelEmbedding, RowParallelConv2d, RowParallelLinear,
                 VocabParallelEmbedding, clip_grad_norm_, vocab_parallel_cross_entropy)
from .convert import (AnalysisReport, DistributedModelWrapper, Family, Plan, PlanError, VerifyReport, parallelize,
                      plan, quiet_conversions, register_family, shard_layouts, unregister_family, verify)
from .layout import ShardLayout
from .estimate import (MemoryEstimate, SpeedEstimate, SpeedProfile, calibrate_profile, estimate_memory, estimate_speed,
                       load_profile, save_profile)
from .checkpoint import CheckpointError, Checkpointer, consolidate, from_pretrained, load_sharded, save_sharded
from .quant import QuantizationError
from .convert.peft.seam import lora_config
from .data_parallel import data_parallel, data_parallel_manual_seed, device_mesh, no_sync
from .recompute import recompute
from .pipeline import Pipeline, PipelineGroups, SplitError, StageSplit, pipeline, pipeline_groups, split_stages
from .replicas import ReplicaError, ReplicaReport, check_replicas, watch_replicas
from .estimate.predict import Setup
from .estimate.search import SearchResult
from .setups import analyze, apply_setup, search
from .context import context_off, context_parallel, gather_sequence
from .experts import KEEP_EXPERTS_WHOLE, expert_parallel, update_expert_bias

__version__ = "0.1.0"

__all__ = [
    "AlgorithmSelector", "CommProfiler", "CommunicationOptimizer", "CostModel", "PinnedBufferPool", "topology",
    "AnalysisReport", "ColumnParallelConv2d", "ColumnParallelLinear", "DistributedModelWrapper", "MemoryEstimate",
    "ParallelEmbedding", "Plan", "PlanError", "RowParallelConv2d", "RowParallelLinear", "SpeedEstimate", "VerifyReport",
    "VocabParallelEmbedding", "analyze", "clip_grad_norm_", "comm", "estimate_memory", "estimate_speed", "nn",
    "parallelize", "plan", "verify", "vocab_parallel_cross_entropy", "ShardLayout", "shard_layouts", "Family",
    "register_family", "unregister_family", "quiet_conversions",
    "CommError", "Communicator", "LaunchError", "ReduceOp", "TPConfig", "__version__", "all_reduce_sum",
    "broadcast_tensor", "create_communicator", "get_communicator", "get_tensor_parallel_config", "init",
    "init_tensor_parallel", "launch", "run_threads", "set_communicator", "shutdown", "synchronize_across_ranks",
    "use_communicator",
    "CheckpointError", "Checkpointer", "consolidate", "from_pretrained", "load_sharded", "save_sharded", "lora_config",
    "QuantizationError",
    "data_parallel", "data_parallel_manual_seed", "device_mesh", "no_sync", "recompute",
    "Pipeline", "PipelineGroups", "SplitError", "StageSplit", "pipeline", "pipeline_groups", "split_stages",
    "ReplicaError", "ReplicaReport", "check_replicas", "watch_replicas",
    "SearchResult", "Setup", "apply_setup", "search",
    "SpeedProfile", "calibrate_profile", "load_profile", "save_profile",
    "context_off", "context_parallel", "gather_sequence",
    "KEEP_EXPERTS_WHOLE", "expert_parallel", "update_expert_bias",
]
