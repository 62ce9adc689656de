"""How fast a model runs at each world size, so a user sees where adding ranks stops paying before buying them:
`estimate_speed`, a row per world size (time per step or per decoded token, its parts, throughput, speedup).

Each world size is one `predict.Setup` (sequence parallelism and recompute for training; `vocab_parallel=False`
keeps the embedding and LM head whole on every rank, as gpt-fast's `tp.py` does) priced by the setup search's own
composition (`predict.predict`: the converter's plan for rank 0 traced op by op on fake tensors, each op, collective
and framework term priced by the machine's rates), so `estimate` and `search` give one figure for one setup. The
machine is `pricing.machine_pricing(profile, hardware, interconnect)`'s, the one every command prices: a measured
profile's rates, or a datasheet's scaled by a profile's achieved fractions (`hardware.datasheet_rates`;
`efficiency`, `memory_efficiency` and `link_efficiency` override those fractions).

A row's time has four parts: kernels bound by arithmetic (`compute_s`), kernels bound by the bytes they move
(`memory_s`), the framework's fixed costs (`framework_s`: none on a datasheet GPU, which queues its kernels ahead)
and communication; the largest names what bounds the step. A module without a Hugging Face config is traced on its
example input (`example_input`, `input_shape`, or the one its first layer implies) with `batch_size` rows; its
throughput counts samples.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch

from ..quant import native
from ..tables import Column, format_bytes, render_table, wrap_text
from .activations import normalise_recompute
from .config import own_dtype, resolve_target
from .context import check_cp, check_priced
from .experts import DEFAULT_IMBALANCE, EXPERTS_NOTE, check_ep, replicas_for
from .hardware import Hardware
from .predict import Prediction, predict
from .pricing import Pricing, machine_pricing
from .profile import SpeedProfile
from .setup import Setup
from .step import module_example

MODES = ("training", "prefill", "decode")
GOAL = {"training": "train", "decode": "decode", "prefill": "prefill"}
PARTS = ("compute", "memory", "framework", "comm")


@dataclass
class SpeedRow:
    """One world size: per-rank work and time of one step (seconds)."""

    world_size: int
    flops_per_rank: float
    bytes_per_rank: float       # bytes the step's kernels read and write
    communication_bytes: float  # bytes of its tensor-parallel collectives' inputs
    collectives: int
    compute_s: float            # kernels bound by arithmetic
    memory_s: float             # kernels bound by the bytes they move
    communication_s: float
    total_s: float
    tokens_per_s: float
    speedup: float = 1.0
    bound: str = ""
    memory_bytes: float = 0.0   # the most tensor bytes the rank's traced step holds
    process_bytes: float = 0.0  # ... and what its process holds at that peak (a measured machine's imports, runtime)
    framework_s: float = 0.0    # the framework's fixed costs (per op, per module, the optimizer's per tensor)

    def parts_s(self) -> tuple[float, float, float, float]:
        """The time's parts in the order of `PARTS`."""
        return self.compute_s, self.memory_s, self.framework_s, self.communication_s


@dataclass
class SpeedEstimate:
    """Step (or token) time and speedup per world size."""

    hardware: str
    interconnect: str
    mode: str
    dtype: str
    batch_size: int
    seq_len: int | None
    rows: list[SpeedRow]
    notes: list[str] = field(default_factory=list)
    unit: str = "tokens"  # what `tokens_per_s` counts: tokens, or samples for a module without a config
    parts: tuple[str, ...] = PARTS  # the time columns, in the order of `SpeedRow.parts_s`
    cp: int = 1  # context-parallel ranks beside each world size's TP ranks (its rows run on world size x cp devices)
    ep: int = 1  # expert-parallel ranks sharing a MoE model's experts (`estimate_speed`'s `ep`)

    def row(self, world_size: int) -> SpeedRow:
        for r in self.rows:
            if r.world_size == world_size:
                return r
        raise KeyError(f"world size {world_size} not estimated; have {[r.world_size for r in self.rows]}")

    def speedup(self, world_size: int) -> float:
        return self.row(world_size).speedup

    def to_dict(self) -> dict[str, Any]:
        return {"hardware": self.hardware, "interconnect": self.interconnect, "mode": self.mode, "dtype": self.dtype,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "unit": self.unit, "cp": self.cp, "ep": self.ep,
                "rows": [asdict(r) for r in self.rows], "notes": list(self.notes), "parts": list(self.parts)}

    def summary(self, width: int | None = None) -> str:
        """A table per world size (fitted to `width` columns; None: natural width), then the notes."""
        unit = "token" if self.mode == "decode" else "step"
        seq = f" x seq {self.seq_len}" if self.seq_len else ""
        seq += f", each world size x cp {self.cp}" if self.cp > 1 else ""
        seq += f", ep {self.ep}" if self.ep > 1 else ""
        names = ("world size", *self.parts, f"time/{unit}", f"{self.unit}/s", "speedup", "bound")
        rows = [[str(r.world_size), *(milliseconds(s) for s in r.parts_s()), milliseconds(r.total_s),
                 f"{r.tokens_per_s:,.0f}", f"{r.speedup:.2f}x", r.bound] for r in self.rows]
        title = f"speed: {self.mode}, {self.dtype}, batch {self.batch_size}{seq}, {self.hardware} over {self.interconnect}"
        lines = [render_table(title, [Column(n) for n in names], rows, width)]
        lines += [wrap_text(f"note: {note}", width, "", "  ") for note in self.notes]
        return "\n".join(lines) + "\n"


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _check(mode: str, world_size, batch_size: int, seq_len: int, fractions) -> list[int]:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    sizes = [world_size] if isinstance(world_size, int) else list(world_size)
    if not sizes or any(not isinstance(t, int) or t < 1 for t in sizes):
        raise ValueError(f"world sizes must be positive ints, got {world_size!r}")
    for name, value in fractions.items():
        if value is not None and not 0 < value <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {value}")
    return sorted(set(sizes))


def estimate_speed(model_or_config, world_size: int | Iterable[int] = (1, 2, 4, 8),
                   hardware: str | Hardware | None = None, interconnect: str | None = None,
                   dtype: torch.dtype | None = None, mode: str = "training",
                   batch_size: int = 1, seq_len: int = 2048, sequence_parallel: bool = False, recompute="none",
                   attention: str | None = None, efficiency: float | None = None,
                   memory_efficiency: float | None = None, link_efficiency: float | None = None,
                   example_input=None, input_shape=None, profile: SpeedProfile | str | None = None,
                   vocab_parallel: bool = True, cp: int = 1, cp_method: str = "auto", ep: int = 1,
                   ep_imbalance: float = DEFAULT_IMBALANCE) -> SpeedEstimate:
    """Step time (training, prefill) or time per decoded token (decode, with a context of `seq_len`) and
    speedup over one device, for each world size (see the module docstring).

    `hardware` (a preset name or a `Hardware`) prices that datasheet with the default profile's achieved fractions
    (or `profile`'s when it is not a measured one); with neither, a measured profile prices this machine, a GPU of
    a known kind its datasheet, and any other machine is measured first (a quick calibration). `attention`: a
    config's attention kernel ("eager", else sdpa). A module without a config: `example_input` or `input_shape`
    (batch first; its batch becomes `batch_size`); training and prefill only. `cp`: context-parallel ranks beside
    every world size's TP ranks (training a transformer; `cp_method` "auto", "all_to_all" or "ring"): each row runs
    on world size x cp devices, its speedup still over one device. `ep`: a mixture-of-experts model's experts spread
    over ep ranks (`tpkit.expert_parallel`, `experts.py`; `ep_imbalance` >= 1: the busiest rank's load over uniform
    routing's): a world size t dividing ep runs on t x cp x dp devices, dp = ep / gcd(ep, t x cp) replicas (DDP in
    training) that make up the expert group, each on `batch_size` sequences, its throughput counting all of them;
    other world sizes are left out (noted)."""
    fractions = {"efficiency": efficiency, "memory_efficiency": memory_efficiency, "link_efficiency": link_efficiency}
    sizes = _check(mode, world_size, batch_size, seq_len, fractions)
    recompute = normalise_recompute(recompute)
    check_cp(cp, cp_method)
    check_ep(ep, ep_imbalance)
    pricing = machine_pricing(profile, hardware, interconnect)
    config, shape = resolve_target(model_or_config, "estimate_speed")
    check_priced(cp, mode, model_or_config)
    if mode == "decode" and shape is not None and not shape.is_decoder:
        raise ValueError(f"estimate_speed: {shape.model_type} is an encoder; it does not decode tokens, use mode "
                         f"'prefill' (one forward) or 'training'")
    dtype = dtype or own_dtype(model_or_config)
    example, notes = None, []
    if shape is None:
        if mode == "decode":
            raise ValueError(f"estimate_speed: mode 'decode' needs a decoder with a Hugging Face config; "
                             f"{type(model_or_config).__name__} is measured, use mode 'training' or 'prefill'")
        example, notes = _module_example(model_or_config, dtype, batch_size, example_input, input_shape, seq_len)
    subject = config if shape is not None else model_or_config
    prof, rates_note = _rates_of(pricing, fractions, dtype.itemsize)
    goal, choices = GOAL[mode], () if vocab_parallel else (("vocab", "whole"),)
    units = batch_size if goal == "decode" or shape is None else batch_size * seq_len
    rows, padded, quantized, replicas = [], [], {}, []
    first = [1] if sizes[0] > 1 or cp > 1 or ep > 1 else []
    sizes = _dividing(sizes, ep, notes) if ep > 1 else sizes
    for i, t in enumerate(first + sizes):  # one device is what the speedup is over
        c, e = (1, 1) if i < len(first) else (cp, ep)
        dp = replicas_for(e, t * c) if e > 1 else 1
        sp = sequence_parallel and t > 1 and goal == "train"
        step = t * (2 * c if c > 1 else 1)  # a cp rank's share (2 x cp chunks) splits further over t
        seq = -(-seq_len // step) * step if sp else seq_len  # sequence parallelism splits the sequence: padded to t
        padded += [f"TP {t}: {seq}"] if seq != seq_len else []
        setup = Setup(t, dp, None if dp == 1 else "ddp" if goal == "train" else "replicas", sequence_parallel=sp,
                      recompute=recompute if goal == "train" else "none", choices=choices, cp=c, cp_method=cp_method,
                      ep=e, ep_imbalance=ep_imbalance)
        p = predict(subject, setup, goal, batch_size * dp, seq, prof, example=example, dtype=dtype,
                    hardware=pricing.hardware, attention=attention)
        rows.append(_row(p, units * dp))
        replicas.append(dp)
        if p.quantized:  # what its quantized layers were priced as (one note per distinct pricing)
            quantized.setdefault(p.quantized, []).append(t)
    if padded:
        notes.append(f"sequence parallelism splits the sequence over the ranks: {seq_len} tokens padded to a multiple "
                     f"of the world size ({', '.join(padded)})")
    for r, dp in zip(rows, replicas):
        r.speedup = rows[0].total_s / r.total_s * dp
    rows, replicas = rows[len(first):], replicas[len(first):]
    notes += [_experts_note(rows, replicas, ep, cp)] if ep > 1 else []
    notes += [note if len(quantized) == 1 else f"TP {', '.join(map(str, ts))}: {note}" for note, ts in quantized.items()]
    notes = [rates_note, *notes, *_notes(rows, pricing, sizes, vocab_parallel)]
    hw = pricing.hardware or pricing.profile.hardware
    name = hw.name if hw is not None else pricing.profile.name
    link = hw.interconnect.name if hw is not None else "its own ranks (measured)"
    return SpeedEstimate(name, link, mode, str(dtype).replace("torch.", ""), batch_size,
                         seq_len if shape is not None else None, rows, notes,
                         unit="tokens" if shape is not None else "samples", cp=cp, ep=ep)


def _row(p: Prediction, units: int) -> SpeedRow:
    """A world size's row from its prediction; the part that takes longest bounds it."""
    memory = p.kernels_s - p.compute_s
    comm = p.tp_communication_s + p.dp_communication_s + p.cp_communication_s + p.ep_communication_s
    parts = {"compute": p.compute_s, "memory": memory, "framework": p.overhead_s, "communication": comm}
    return SpeedRow(p.setup.tp, p.flops, p.nbytes, p.collective_bytes, p.collectives, p.compute_s, memory, comm,
                    p.seconds, units / p.seconds, 1.0, max(parts, key=parts.get), p.memory_bytes, p.process_bytes,
                    p.overhead_s)


def _dividing(sizes: list[int], ep: int, notes: list[str]) -> list[int]:
    """The world sizes that divide `ep` (an expert group holds whole TP groups); the others noted as left out."""
    kept, left = [t for t in sizes if ep % t == 0], [t for t in sizes if ep % t]
    if not kept:
        raise ValueError(f"estimate_speed: ep {ep} is not a multiple of any world size asked ({sizes}): an expert "
                         f"group holds whole TP groups; ask for world sizes dividing {ep}")
    notes += [f"world sizes {', '.join(map(str, left))} left out: ep {ep} is not a multiple of them"] if left else []
    return kept


def _experts_note(rows: list[SpeedRow], replicas: list[int], ep: int, cp: int) -> str:
    each = [f"{r.world_size} on {r.world_size * cp * dp} devices ({dp} replica{'s' * (dp > 1)})"
            for r, dp in zip(rows, replicas)]
    return (f"expert parallelism over ep {ep}: TP " + "; ".join(each)
            + f", each replica's tokens counted; {EXPERTS_NOTE}")


def _rates_of(pricing: Pricing, fractions: dict[str, float | None], item: int) -> tuple[SpeedProfile, str]:
    """The profile to price with (a datasheet's fractions replaced by those given) and the note that says what
    prices: the measured profile, or the datasheet's peaks and the fractions applied."""
    prof = pricing.profile
    if pricing.hardware is None:
        ignored = [k for k, v in fractions.items() if v is not None]
        return prof, pricing.origin + (f"; {', '.join(ignored)} not applied: the rates are measured" if ignored else "")
    hw = pricing.hardware
    link = prof.link(hw.interconnect)
    if fractions["link_efficiency"] is not None:
        link = dataclasses.replace(link, bandwidth_efficiency=fractions["link_efficiency"])
    eff = prof.flops_efficiency if fractions["efficiency"] is None else fractions["efficiency"]
    mem = prof.memory_efficiency if fractions["memory_efficiency"] is None else fractions["memory_efficiency"]
    prof = dataclasses.replace(prof, flops_efficiency=eff, memory_efficiency=mem,
                               links={**prof.links, hw.interconnect.kind: link})
    note = (f"{hw.name}: {hw.peak_flops(item) / 1e12:.3g} TFLOP/s peak, {hw.memory_bandwidth / 1e9:.3g} GB/s HBM, {hw.interconnect.name}; profile {prof.name!r}: FLOP/s "
            f"x{eff:g}, HBM x{mem:g}, link x{link.bandwidth_efficiency:g}, {link.collective_latency_s * 1e6:g} us "
            f"per collective + {link.hop_latency_s * 1e6:g} us per hop; each op of the traced step priced at them")
    return prof, note


def _module_example(model, dtype, batch_size: int, example_input, input_shape, seq_len) -> tuple[Any, list[str]]:
    """A module's example call on the meta device with `batch_size` rows (each tensor whose first dimension is the
    example's batch), and notes."""
    args, kwargs, batch, notes = module_example(model, dtype, example_input, input_shape, seq_len)

    def meta(v):
        if not isinstance(v, torch.Tensor):
            return v
        shape = (batch_size, *v.shape[1:]) if v.dim() and v.shape[0] == batch else tuple(v.shape)
        return torch.empty(shape, dtype=v.dtype, device="meta")
    example = {k: meta(v) for k, v in kwargs.items()} if kwargs else tuple(meta(a) for a in args)
    return example, [f"{type(model).__name__}: traced on one fake step of its example input at batch {batch_size}; "
                     f"throughput is in samples/s", *notes]


STREAM_DRIFT = 0.15  # the streaming bandwidth's move during a calibration past which an estimate says so


def _notes(rows: list[SpeedRow], pricing: Pricing, sizes: list[int], vocab_parallel: bool) -> list[str]:
    """What a rank holds at each world size, and where the figures are for another machine."""
    notes = []
    if pricing.measured:
        rates = pricing.profile.rates(1)
        notes.append("a rank's process at its peak (the traced step's tensors + imports + runtime, measured here): "
                     + "; ".join(f"TP {r.world_size}: {format_bytes(r.process_bytes)} ({format_bytes(r.memory_bytes)}"
                                 f" + {format_bytes(rates.import_bytes)} + {format_bytes(rates.runtime_bytes)})"
                                 for r in rows))
        moved = max((pricing.profile.rates(t) for t in sizes), key=lambda r: r.stream_drift())
        if moved.stream_drift() > STREAM_DRIFT:
            who = "1 rank" if moved.ranks == 1 else f"{moved.ranks} ranks"
            notes.append(f"this machine's memory bandwidth moved during the calibration ({who} reading: "
                         f"{moved.stream_bandwidth / 1e9:.1f} GB/s per rank at its start, "
                         f"{moved.stream_bandwidth_end / 1e9:.1f} at its end): its rates hold for neither, and decode "
                         f"figures may be off by as much; calibrate again when the machine is quiet "
                         f"(`tpkit estimate --calibrate`)")
        build = native.build_id() if rates.product_build else ""
        if build and rates.product_build != build:
            notes.append(f"the profile's product rates were measured with another build of tpkit's compiled product "
                         f"({rates.product_build}; this one: {build}): decode products are priced as they ran then; "
                         f"recalibrate (`tpkit estimate --calibrate`)")
    else:
        notes.append("the most tensor bytes a rank holds in the traced step: "
                     + "; ".join(f"TP {r.world_size}: {format_bytes(r.memory_bytes)}" for r in rows))
    beyond = [t for t in sizes if pricing.measured and pricing.beyond(t)]
    if beyond:
        notes.append(f"world sizes {', '.join(map(str, beyond))} exceed this machine's {pricing.devices} "
                     f"{pricing.device_kind}: priced with the rates measured for the most ranks calibrated, a figure "
                     f"for a larger machine like this one, not a setup to run here")
    if not vocab_parallel:
        notes.append("embedding and LM head replicated on every rank (vocab_parallel=False)")
    return notes


__all__ = ["MODES", "PARTS", "SpeedEstimate", "SpeedRow", "estimate_speed"]
