"""Memory per rank before buying the devices: parameters, gradients, optimizer states, activations,
KV cache and communication buffers, at world size 1 and at world size t.

One concept per module; this package only gathers their public names (and the few private helpers the speed
estimate shares), so `from tpkit.convert.estimate import ...` keeps working as when it was one module:

    config         TransformerShape, read from a Hugging Face config; what an estimate was asked about
    ranks          heads, MLP width and vocabulary one rank holds (the converter's head layout)
    params         parameter counts per rank, optimizer state bytes
    activations    the Korthikanti et al. 2022 formula and its per-architecture terms; inference working set
    communication  the largest collective buffer
    step, measure  any other module: one small real step, measured and attributed to a rank by the plan
    report         MemoryEstimate / Breakdown, the result, and its table
    memory         estimate_memory, the entry that picks the formula or the measured path
"""
from __future__ import annotations

from .activations import (_normalise_recompute, korthikanti_layer_bytes, transformer_activation_bytes,
                          transformer_inference_bytes)
from .communication import largest_collective_bytes
from .config import TransformerShape, _attention_kind, _own_dtype, resolve_target, transformer_shape
from .measure import measure_step
from .memory import estimate_memory
from .params import fullest_rank, optimizer_bytes_per_parameter, parameter_counts
from .ranks import rank_heads
from .report import Breakdown, MemoryEstimate, format_bytes
from .step import prepare_module_step

__all__ = ["Breakdown", "MemoryEstimate", "TransformerShape", "estimate_memory", "format_bytes",
           "korthikanti_layer_bytes", "largest_collective_bytes", "measure_step",
           "optimizer_bytes_per_parameter", "parameter_counts", "prepare_module_step", "rank_heads", "fullest_rank",
           "transformer_activation_bytes", "transformer_inference_bytes", "transformer_shape"]
