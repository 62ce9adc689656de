"""How fast a transformer runs at each TP world size: a roofline per rank plus an alpha-beta model of the
collectives, so a user sees where adding ranks stops paying before buying them.

Per rank and per step (a training step, a prefill forward, or one decoded token):

* compute time = FLOPs / peak. FLOPs = 2 * tokens * matmul parameters on the rank (q, k, v, o, MLP, LM
  head; embeddings are look-ups) + attention scores, 4 * b * s_q * s_kv * (a/t) * d per layer (halved for
  causal decoders, as fused kernels skip the masked half). Training = 3 x forward (backward is two matmuls
  per forward one); full recompute adds a forward, selective adds the attention scores again.
* memory time = bytes / HBM bandwidth: weights on the rank read once per pass (training: forward, backward
  and the gradient write), activations written and read back once, and for decoding the KV cache read.
* roofline time = max(compute, memory): the step is bound by whichever is slower.
* communication (Megatron TP): 2 all-reduces of (b, s, h) per layer forward (after attention and the MLP),
  2 more in backward; the vocab-parallel embedding's all-reduce; inference gathers the logits. With
  sequence parallelism each all-reduce becomes an all-gather plus a reduce-scatter: the same bytes.
  Ring all-reduce: fixed cost + 2(t-1)/t * bytes / link bandwidth + 2(t-1) * hop latency; all-gather: half
  the steps and bytes.
* step time = roofline + communication (no overlap assumed: TP collectives sit on the critical path).

Peaks come from `hardware.py` (datasheet figures); the speed profile (`profile.py`: by default calibrated on
published runs, or measured here by `tpkit estimate --calibrate`) scales them to what kernels and collectives
reach. `efficiency`, `memory_efficiency` and `link_efficiency` override the profile's fractions.
`vocab_parallel=False` models embedding and LM head replicated on every rank (gpt-fast's `tp.py`): no
embedding all-reduce, no logits gather, whole vocabulary weights on each rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from ..layout import split_sizes
from ..tables import format_bytes
from .activations import normalise_recompute, transformer_activation_bytes
from .config import TransformerShape, attention_kind, own_dtype, resolve_target
from .hardware import Hardware, get_hardware
from .params import fullest_rank, parameter_counts, split_alone
from .profile import SpeedProfile
from .ranks import rank_cache_heads, rank_heads
from .speed_report import SpeedEstimate, SpeedRow

MODES = ("training", "prefill", "decode")


def ring_all_reduce_seconds(nbytes: float, world_size: int, bandwidth: float, latency_s: float,
                            fixed_s: float = 0.0) -> float:
    """Ring all-reduce: each rank sends and receives 2(t-1)/t of the message in 2(t-1) steps of `latency_s`,
    plus `fixed_s` per collective (launch and synchronisation)."""
    if world_size == 1:
        return 0.0
    t = world_size
    return fixed_s + 2 * (t - 1) / t * nbytes / bandwidth + 2 * (t - 1) * latency_s


def ring_all_gather_seconds(nbytes_total: float, world_size: int, bandwidth: float, latency_s: float,
                            fixed_s: float = 0.0) -> float:
    """Ring all-gather of a result of `nbytes_total`: (t-1)/t of it crosses each link in t-1 steps."""
    if world_size == 1:
        return 0.0
    t = world_size
    return fixed_s + (t - 1) / t * nbytes_total / bandwidth + (t - 1) * latency_s


@dataclass(frozen=True)
class _Rates:
    """What one step is timed with: achieved FLOP/s and bytes/s, the link's bytes/s, per-hop latency and
    fixed cost per collective, and whether the vocabulary is split."""

    flops: float
    memory: float
    link: float
    hop_s: float
    fixed_s: float
    vocab_parallel: bool = True

    def all_reduce(self, nbytes: float, t: int) -> float:
        return ring_all_reduce_seconds(nbytes, t, self.link, self.hop_s, self.fixed_s)

    def all_gather(self, nbytes: float, t: int) -> float:
        return ring_all_gather_seconds(nbytes, t, self.link, self.hop_s, self.fixed_s)


def _matmul_params(shape: TransformerShape, t: int, vocab_parallel: bool = True) -> float:
    """Weights that multiply every token on the rank: attention, MLP, the LM head (tied or not)."""
    counts = parameter_counts(shape, t)
    h = shape.hidden_size
    vocab = split_sizes(shape.vocab_size, t)[fullest_rank(shape, t)] if vocab_parallel else shape.vocab_size
    lm_head = vocab * h + (h * h if shape.mlm_head else 0)
    return counts["attention"] + counts["mlp"] + lm_head


def _rank_parameters(shape: TransformerShape, t: int, vocab_parallel: bool) -> int:
    counts = parameter_counts(shape, t)
    if not vocab_parallel:  # embedding and LM head whole on every rank
        whole = parameter_counts(shape, 1)
        counts["embeddings"], counts["lm_head"] = whole["embeddings"], whole["lm_head"]
    return sum(counts.values())


def _step(shape: TransformerShape, t: int, mode: str, B: int, b: int, s: int, recompute: str,
          sequence_parallel: bool, attention: str, rates: _Rates) -> SpeedRow:
    L, h, d = shape.num_layers, shape.hidden_size, shape.head_dim
    q_heads, kv_heads, _ = rank_heads(shape.num_heads, shape.num_kv_heads, t, fullest_rank(shape, t))
    cached = rank_cache_heads(shape.num_heads, shape.num_kv_heads, t, fullest_rank(shape, t))
    causal = 0.5 if shape.is_decoder else 1.0
    if mode == "decode":
        tokens, s_q, s_kv = b, 1, s
        causal = 1.0
    else:
        tokens, s_q, s_kv = b * s, s, s
    score_flops = L * 4 * b * s_q * s_kv * q_heads * d * causal
    forward = 2 * tokens * _matmul_params(shape, t, rates.vocab_parallel) + score_flops
    weight_bytes = _rank_parameters(shape, t, rates.vocab_parallel) * B
    if mode == "training":
        flops = 3 * forward + (forward if recompute == "full" else score_flops if recompute == "selective" else 0)
        acts = sum(transformer_activation_bytes(shape, b, s, B, t, sequence_parallel and t > 1, recompute,
                                                attention).values())
        nbytes = 3 * weight_bytes + 2 * acts
    elif mode == "decode":
        flops = forward
        kv_cache = 2 * L * b * s * cached * d * B
        nbytes = weight_bytes + kv_cache
    else:
        flops = forward
        nbytes = weight_bytes + 2 * L * tokens * (h + 2 * kv_heads * d) * B

    message = tokens * h * B
    passes = 1 if mode != "training" else 2  # training: each forward collective once more in the backward
    alone = split_alone(shape, t)
    per_layer = (1 if "attention" in alone else 2) * passes  # attention split alone: gathers below, no all-reduce
    vocab = 1 if rates.vocab_parallel else 0
    all_reduces = L * per_layer + vocab * (1 + (1 if mode == "training" else 0))  # + embedding (+ LM-head input)
    comm_s = all_reduces * rates.all_reduce(message, t)
    comm_bytes = all_reduces * (2 * (t - 1) / t * message if t > 1 else 0)
    collectives = all_reduces if t > 1 else 0
    for part, layers in alone.items():  # layers split alone all-gather their outputs on every call, and training
        for n_in, out, _ in layers:     # all-reduces their input's gradient (the gather's backward only slices)
            calls, gathered, summed = L if part == "attention" else 1, tokens * out * B, tokens * n_in * B
            comm_s += calls * rates.all_gather(gathered, t)
            comm_bytes += calls * ((t - 1) / t * gathered if t > 1 else 0)
            collectives += calls
            if mode == "training":
                comm_s += calls * rates.all_reduce(summed, t)
                comm_bytes += calls * (2 * (t - 1) / t * summed if t > 1 else 0)
                collectives += calls
    if mode == "training" and vocab:   # vocab-parallel cross entropy: max, sum-exp and target logit, fp32
        comm_s += 3 * rates.all_reduce(tokens * 4, t)
        comm_bytes += 3 * (2 * (t - 1) / t * tokens * 4 if t > 1 else 0)
        collectives += 3 if t > 1 else 0
    elif vocab:                        # gather the logits of the last position
        logits = b * shape.vocab_size * B
        comm_s += rates.all_gather(logits, t)
        comm_bytes += (t - 1) / t * logits if t > 1 else 0
        collectives += 1 if t > 1 else 0
    return _row(t, flops, nbytes, comm_bytes, collectives, flops / rates.flops, nbytes / rates.memory, comm_s,
                b if mode == "decode" else tokens)


def _row(t, flops, nbytes, comm_bytes, collectives, compute_s, memory_s, comm_s, units) -> SpeedRow:
    roof = max(compute_s, memory_s)
    total = roof + comm_s
    bound = "communication" if comm_s > roof else "compute" if compute_s >= memory_s else "memory"
    return SpeedRow(t, flops, nbytes, comm_bytes, collectives, compute_s, memory_s, comm_s, total, units / total,
                    1.0, bound)


def _rates(hw: Hardware, profile: SpeedProfile, B: int, efficiency, memory_efficiency, link_efficiency,
           vocab_parallel: bool) -> tuple[_Rates, str]:
    """Achieved rates: the profile's fractions of the peaks, unless an efficiency is given; and a note."""
    link = profile.link(hw.interconnect)
    eff = profile.flops_efficiency if efficiency is None else efficiency
    mem = profile.memory_efficiency if memory_efficiency is None else memory_efficiency
    lnk = link.bandwidth_efficiency if link_efficiency is None else link_efficiency
    for name, value in (("efficiency", eff), ("memory_efficiency", mem), ("link_efficiency", lnk)):
        if not 0 < value <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {value}")
    rates = _Rates(hw.peak_flops(B) * eff, hw.memory_bandwidth * mem, hw.interconnect.bandwidth * lnk,
                   link.hop_latency_s, link.collective_latency_s, vocab_parallel)
    note = (f"{hw.name}: {hw.peak_flops(B) / 1e12:.3g} TFLOP/s peak, {hw.memory_bandwidth / 1e9:.3g} GB/s HBM, "
            f"{hw.interconnect.name}; profile {profile.name!r}: FLOP/s x{eff:g}, HBM x{mem:g}, link x{lnk:g}, "
            f"{link.collective_latency_s * 1e6:g} us per collective + {link.hop_latency_s * 1e6:g} us per hop")
    return rates, note


def estimate_speed(model_or_config, world_size: int | Iterable[int] = (1, 2, 4, 8),
                   hardware: str | Hardware | None = None, interconnect: str | None = None,
                   dtype: torch.dtype | None = None, mode: str = "training",
                   batch_size: int = 1, seq_len: int = 2048, sequence_parallel: bool = False, recompute="none",
                   attention: str | None = None, efficiency: float | None = None,
                   memory_efficiency: float | None = None, link_efficiency: float | None = None,
                   example_input=None, input_shape=None, profile: SpeedProfile | str | None = None,
                   vocab_parallel: bool = True) -> SpeedEstimate:
    """Step time (training, prefill) or time per decoded token (decode, with a context of `seq_len`) and
    speedup over one device, for each world size.

    Transformers (an HF config or a model with one) are modelled from their shape. Any other module is
    measured on one fake step (pass `example_input` or `input_shape`, batch first): FLOPs with
    `torch.utils.flop_counter`, those inside column -> row pairs divided over the ranks, and the
    collectives the converter's plan adds; the step is scaled to `batch_size` and `tokens_per_s` counts
    samples. Training counts backward as twice the forward FLOPs, and each forward collective once more.

    The machine priced is `tpkit.estimate.pricing.machine_pricing(profile, hardware, interconnect)`'s, the one
    `tpkit estimate`, `search` and `analyze` price: a measured profile prices a transformer op by op
    (`machine_speed.speed_on_machine`, the setup search's model: the table's parts are then kernels, framework
    and communication); `hardware` (a preset name or a `Hardware`) prices that datasheet with the default
    profile's achieved fractions (or `profile`'s when it is not a measured one); with neither, a GPU of a known
    kind is priced from its datasheet and any other machine is measured first (a quick calibration).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    sizes = [world_size] if isinstance(world_size, int) else list(world_size)
    if not sizes or any(not isinstance(t, int) or t < 1 for t in sizes):
        raise ValueError(f"world sizes must be positive ints, got {world_size!r}")
    recompute = normalise_recompute(recompute)
    for name, value in (("efficiency", efficiency), ("memory_efficiency", memory_efficiency),
                        ("link_efficiency", link_efficiency)):
        if value is not None and not 0 < value <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {value}")
    from .pricing import machine_pricing

    pricing = machine_pricing(profile, hardware, interconnect)
    profile = pricing.profile
    config, shape = resolve_target(model_or_config, "estimate_speed")
    if mode == "decode" and shape is not None and not shape.is_decoder:
        raise ValueError(f"estimate_speed: {shape.model_type} is an encoder; it does not decode tokens, use mode "
                         f"'prefill' (one forward) or 'training'")
    if pricing.measured and shape is not None:
        from .machine_speed import speed_on_machine  # this machine, priced op by op as the setup search does

        return speed_on_machine(config, sizes, pricing, mode, batch_size, seq_len, dtype, sequence_parallel,
                                recompute)
    hw = get_hardware(pricing.hardware or profile.hardware, interconnect)
    dtype = dtype or own_dtype(model_or_config)
    B = dtype.itemsize
    rates, hw_note = _rates(hw, profile, B, efficiency, memory_efficiency, link_efficiency, vocab_parallel)
    config, shape = resolve_target(model_or_config, "estimate_speed")
    if shape is None:
        if mode == "decode":
            raise ValueError(f"estimate_speed: mode 'decode' needs a decoder with a Hugging Face config; "
                             f"{type(model_or_config).__name__} is measured, use mode 'training' or 'prefill'")
        return _measured_speed(model_or_config, sorted(set(sizes)), hw, dtype, mode, batch_size, seq_len,
                               example_input, input_shape, rates, hw_note)
    kind = attention_kind(config, attention)
    if mode == "decode" and not shape.is_decoder:
        raise ValueError(f"estimate_speed: {shape.model_type} is an encoder; it does not decode tokens, use mode "
                         f"'prefill' (one forward) or 'training'")
    args = (mode, B, batch_size, seq_len, recompute, sequence_parallel, kind, rates)
    base = _step(shape, 1, *args)
    rows = []
    for t in sorted(set(sizes)):
        row = base if t == 1 else _step(shape, t, *args)
        row.speedup = base.total_s / row.total_s
        rows.append(row)
    notes = [hw_note, f"weights per rank at t=1: {format_bytes(sum(parameter_counts(shape, 1).values()) * B)}"]
    if not vocab_parallel:
        notes.append("embedding and LM head replicated on every rank (vocab_parallel=False)")
    return SpeedEstimate(hw.name, hw.interconnect.name, mode, str(dtype).replace("torch.", ""), batch_size, seq_len,
                         rows, notes)


def _measured_speed(model: nn.Module, sizes: list[int], hw: Hardware, dtype: torch.dtype, mode: str,
                    batch_size: int, seq_len: int, example_input, input_shape, rates: _Rates,
                    hw_note: str) -> SpeedEstimate:
    from .measure import measure_step
    from .step import prepare_module_step

    training = mode == "training"
    rows, notes = [], []
    for t in sizes:
        step = prepare_module_step(model, t, dtype, "training" if training else "inference", example_input,
                                   input_shape, seq_len)
        m = measure_step(step["work"], step["args"], step["kwargs"], step["styles"], t, training)
        scale = batch_size / step["batch"]
        notes = step["notes"] or notes
        flops = m["flops_per_rank"] * scale * (3 if training else 1)
        acts = m["activations_per_rank"] * scale
        nbytes = (3 if training else 1) * m["parameter_bytes_per_rank"] + 2 * acts
        comm_s = comm_bytes = 0.0
        for kind, n in m["collectives"]:
            n *= scale
            if kind == "all_reduce":
                comm_s += rates.all_reduce(n, t)
                comm_bytes += 2 * (t - 1) / t * n
            else:
                comm_s += rates.all_gather(n, t)
                comm_bytes += (t - 1) / t * n
        repeat = 2 if training else 1
        rows.append(_row(t, flops, nbytes, repeat * comm_bytes, repeat * len(m["collectives"]), flops / rates.flops,
                         nbytes / rates.memory, repeat * comm_s, batch_size))
    base = rows[0] if rows[0].world_size == 1 else None
    if base is None:
        base = _measured_speed(model, [1], hw, dtype, mode, batch_size, seq_len, example_input, input_shape, rates,
                               hw_note).rows[0]
    for r in rows:
        r.speedup = base.total_s / r.total_s
    notes = [f"{type(model).__name__}: FLOPs, bytes and collectives measured on one fake step and scaled to "
             f"batch {batch_size}; throughput is in samples/s", hw_note] + notes
    return SpeedEstimate(hw.name, hw.interconnect.name, mode, str(dtype).replace("torch.", ""), batch_size, None,
                         rows, notes, unit="samples")


__all__ = ["SpeedEstimate", "SpeedRow", "estimate_speed", "ring_all_gather_seconds", "ring_all_reduce_seconds"]
