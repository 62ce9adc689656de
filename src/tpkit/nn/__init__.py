"""`tpkit.nn`: tensor-parallel layers whose forward and backward on N ranks equal one big layer on one device.

Every communication is one of the conjugate autograd pairs in `mappings`; layers compose them. What each rank
holds is said by the layers (`PARTITION_DIMS`, `partition_sizes`) and by the model's record (`record`: layouts by
state-dict key, never attributes on Parameters), and each layer has `from_module(m, comm=None)` to shard an
existing `nn.Linear` / `nn.Embedding` / `nn.Conv2d`. `comm=None` means `tpkit.get_communicator()` at construction
time.
"""
from __future__ import annotations

from ._layer import TensorParallelModule
from .conv import ColumnParallelConv2d, RowParallelConv2d
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import ParallelEmbedding, VocabParallelEmbedding
from .experts import ExpertsRegion
from .linear import ColumnParallelLinear, RowParallelLinear
from .grad_sums import GradSum, grad_sums, sum_grads, unsummed
from .mappings import (copy_rows_to_region, copy_to_region, gather_from_region, gather_from_sequence_region,
                       reduce_from_region, reduce_scatter_to_sequence_region, scatter_to_region,
                       scatter_to_sequence_region)
from .grad_clip import clip_grad_norm_
from .partition import partition_sizes, shard
from .record import ModelRecord, attach_record, communicator_of, find_record, record_of
from .random import (DATA_PARALLEL_RNG, MODEL_PARALLEL_RNG, RNGStatesTracker, get_rng_tracker,
                     model_parallel_manual_seed)
from .sequence_parallel import mark_sequence_parallel, sync_sequence_parallel_grads
from .sentinel import SentinelError
from .split_logits import SplitLogits, gather_logits

__all__ = [
    # layers
    "ColumnParallelConv2d", "ColumnParallelLinear", "ParallelEmbedding", "RowParallelConv2d", "RowParallelLinear",
    "TensorParallelModule", "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "ExpertsRegion",
    # communication mappings
    "copy_rows_to_region", "copy_to_region", "gather_from_region", "gather_from_sequence_region",
    "reduce_from_region", "reduce_scatter_to_sequence_region", "scatter_to_region", "scatter_to_sequence_region",
    # gradients summed over the ranks that share a parameter
    "GradSum", "grad_sums", "sum_grads", "unsummed",
    # sharding, and the record of a model's parameters
    "partition_sizes", "shard", "ModelRecord", "attach_record", "communicator_of", "find_record", "record_of",
    # training helpers
    "DATA_PARALLEL_RNG", "MODEL_PARALLEL_RNG", "RNGStatesTracker", "clip_grad_norm_", "get_rng_tracker",
    "mark_sequence_parallel", "model_parallel_manual_seed", "sync_sequence_parallel_grads",
    # what a converted model's outputs and forward give stock tools
    "SentinelError", "SplitLogits", "gather_logits",
]
