"""`tpkit.estimate`: the figures to decide with before any hardware is at hand (memory per rank, time per step or
token, the fastest setup), read off the converter's plans. One fake run of a converted copy feeds memory and speed;
one composition prices every machine, measured or known by its datasheet.

What is asked about
    config          TransformerShape, read from a Hugging Face config; what an estimate was asked about
    presets         published model configs by name, and CLI targets (a preset, a config file, module:factory)
    calls           how a model is called: an example as (args, kwargs), weightless copies, a config at n layers,
                    the models a setup's step is traced on
    step            a plain module's example call (given, from a shape, or implied by its first layer)

The one fake run
    fake_step       one step of a weightless copy converted for one rank, on fake tensors (the estimates' only
                    FakeTensorMode): the op trace, the bytes saved for backward, the peak, the parameter shapes
    ops             what it writes down: every aten op (FLOPs, bytes, phase, the new pages of large outputs) and
                    every collective the plan adds
    peak            the most tensor bytes a step holds at once (LiveBytes)
    trace_memo      the traces this process made, kept by what they are made of: asked again, not traced again

Memory
    memory          estimate_memory, the entry that picks the traced, the formula or the measured path
    traced          activations and parameter shapes per rank from the fake run's training forward, extrapolated
    activations     the Korthikanti et al. 2022 formula and its per-architecture terms; inference working set
    params          parameter counts per rank, optimizer state bytes
    ranks           heads, MLP width and vocabulary one rank holds (the converter's head layout)
    communication   the largest collective buffer
    context         context parallelism: a rank's share of the sequence, the attention method, its traffic and
                    working set, and their price
    experts         expert parallelism: the experts a rank holds at each ep, the runtime's dispatch traced with
                    uniform routing's sizes (imbalance factor), its all-to-alls and the expert-data all-reduce, the
                    ep sizes a layout can carve, and the expert memory table (`tpkit analyze`)
    sequences       activations by sequence length and cp, and the longest sequence that fits (`tpkit analyze`)
    measure         a plain module's forward followed leaf by leaf: activations attributed to a rank by the plan
    report          MemoryEstimate / Breakdown, the result, and its table

Speed: one pricing engine
    setup           Setup: how a model runs on pp x dp x cp x tp devices (and ep of them sharing the experts)
    predict         Prediction: a setup's traced step priced op by op at a machine's rates
    speed           estimate_speed: each world size a Setup through predict; SpeedEstimate and its table
    pipeline        a setup with pipeline stages, priced from the same setup without them: the bubble, the sends
    search          the setup search: every setup tpkit can build, predicted, filtered by memory, ranked
    measured        the search's top setups run for real: launches taking turns, a tie where they overlap
    pricing         which machine every command prices: a measured profile, a named or detected datasheet, or
                    this machine measured now
    quantized       a quantized checkpoint's linear layers: the product each rank's load runs, its stored bytes,
                    its price (a calibrated table, else a stated rule), and the calibration that times them
    machine         MachineRates: what a rank achieves (per-op cost, matmul tables, bandwidths, collectives,
                    framework terms), the one record predict prices with
    hardware        datasheets (A100, H100, H200 and their links), and datasheet_rates: a datasheet as MachineRates
    profile         SpeedProfile: a datasheet's achieved fractions (DEFAULT_PROFILE) or measured rates; JSON files

Measuring this machine (`tpkit estimate --calibrate`)
    calibrate       calibrate_profile: matmul, bandwidth, collective and skew measurements over 1 .. N ranks
    bandwidth       how fast a rank's memory moves: weights streamed, elementwise work, new pages for large tensors
    reference       the per-op fixed cost and a collective's in-step cost, on a small reference model
    framework       the framework's own time per module of each family, caches flushed between modules
    process_memory  what this process holds (/proc): imports, a step's runtime
    terms           a measured profile's terms, one line each (what --calibrate prints)
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
