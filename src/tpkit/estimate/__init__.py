"""`tpkit.estimate`: the figures to decide with before any hardware is at hand, read off the converter's plans.

    config         TransformerShape, read from a Hugging Face config; what an estimate was asked about
    ranks          heads, MLP width and vocabulary one rank holds (the converter's head layout)
    params         parameter counts per rank, optimizer state bytes
    activations    the Korthikanti et al. 2022 formula and its per-architecture terms; inference working set
    traced         activations traced off a weightless copy converted per rank (exact for any module)
    communication  the largest collective buffer
    calls, step, measure   any other module: one small real step, measured and attributed to a rank by the plan
    report         MemoryEstimate / Breakdown, the result, and its table
    memory         estimate_memory, the entry that picks the formula, the traced or the measured path
    hardware, profile, calibrate   what a device and its links do, fitted to measurements (speed profiles)
    speed          estimate_speed: decode / prefill / training time from the same shapes
    presets        published model configs by name, and CLI targets
"""
from __future__ import annotations

from .activations import korthikanti_layer_bytes, transformer_activation_bytes, transformer_inference_bytes
from .calibrate import calibrate_profile
from .communication import largest_collective_bytes
from .config import TransformerShape, resolve_target, transformer_shape
from .measure import measure_step
from .memory import estimate_memory
from .params import fullest_rank, optimizer_bytes_per_parameter, parameter_counts
from .profile import SpeedProfile, load_profile, save_profile
from .ranks import rank_heads
from .report import Breakdown, MemoryEstimate
from .speed import SpeedEstimate, estimate_speed
from .step import prepare_module_step

__all__ = ["Breakdown", "MemoryEstimate", "SpeedEstimate", "SpeedProfile", "TransformerShape", "calibrate_profile",
           "estimate_memory", "estimate_speed", "fullest_rank", "korthikanti_layer_bytes", "largest_collective_bytes",
           "load_profile", "measure_step", "optimizer_bytes_per_parameter", "parameter_counts", "prepare_module_step",
           "rank_heads", "resolve_target", "save_profile", "transformer_activation_bytes",
           "transformer_inference_bytes", "transformer_shape"]
