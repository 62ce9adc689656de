"""The setup search: for a model, a device count and a goal, every way to run it that tpkit can build, priced on
the machine at hand, the ones that do not fit memory dropped, the rest ranked by predicted time.

Candidates (`candidates`): every tensor-parallel size dividing the devices, data parallelism over the rest
(DDP or FSDP2 for training; independent replicas for inference, each taking its share of the batch), sequence
parallelism and recompute (training), pipeline stages (training: pp x tp x dp, priced with their bubble and sends,
`pipeline.py`), context parallelism (training a model whose attention `tpkit.context_parallel` can split over the
sequence: tp x dp x cp, `context_candidates`), expert parallelism (a model with fused experts: tp x dp with an expert
group of ep ranks, `expert_candidates`), and each architecture family's alternatives as its proposals offer them
(attention split by heads or whole, MLP pairs split or whole, the LM head vocab-parallel or replicated, experts
TP, EP or whole): one family's alternative at a time over the defaults, so the count stays linear in the
alternatives. Each is predicted by `predict.predict` (one traced step per distinct conversion, reused for the
setups that only differ in DP mode or recompute). With `measure=K` the top K run for a few steps on real ranks
(the runner `tpkit.search` passes in) and the measured best is picked, as DeepSpeed's autotuner does.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from ..convert.errors import PlanError
from ..convert.planning.planner import propose
from ..convert.trace import analyze_structure
from ..tables import Column, format_bytes, render_table, wrap_text
from .calls import meta_copy, with_layers
from .context import context_refusal
from .experts import EXPERTS_NOTE, ExpertLayers, expert_layers, valid_eps
from .measured import inseparable, median, run_alternating, runs_text
from .predict import Prediction, predict, split_of, trace_setup
from .profile import SpeedProfile, load_profile
from .setup import Setup

GOALS = ("decode", "prefill", "train")
#: Two predictions closer than this (relative) are a tie: the estimate's own error on shapes it was never fitted on is
#: a few percent (median 3-8% on this project's CPU box, BENCHMARKS.md), so it cannot rank them.
NOISE = 0.05
Runner = Callable[[Any, Setup, str, int, int], float]  # (model, setup, goal, batch, seq) -> measured seconds


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One setup: its prediction, whether it fits the memory cap, its measured time when it was run, and (for
    the best) the plan to convert with. Reads as its setup: `.tp`, `.dp`, `.dp_mode`, `.sequence_parallel`,
    `.recompute`."""

    prediction: Prediction
    fits: bool
    measured_s: float | None = None  # the median of its launches
    plan: Any = None
    measured_runs: tuple[float, ...] = ()  # seconds of each launch (`measured.py`)

    @property
    def setup(self) -> Setup:
        return self.prediction.setup

    @property
    def runs(self) -> tuple[float, ...]:
        """Its launches' seconds (its measured time alone when only that was given; none when not measured)."""
        return self.measured_runs or (() if self.measured_s is None else (self.measured_s,))

    def __getattr__(self, name: str):
        if name in ("tp", "dp", "dp_mode", "sequence_parallel", "recompute", "devices", "choices", "pp",
                    "microbatches", "stages_per_rank", "schedule", "cp", "cp_method", "ep", "ep_imbalance"):
            return getattr(self.prediction.setup, name)
        raise AttributeError(name)

    def parallelize_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `tpkit.parallelize` (or `from_pretrained`) for this setup, on its tp communicator."""
        mode = "training" if self.prediction.goal == "train" else "inference"
        return {"plan": self.plan if self.plan is not None else "auto", "mode": mode,
                "sequence_parallel": self.setup.sequence_parallel}

    def context_parallel_kwargs(self) -> dict[str, Any] | None:
        """Keyword arguments of `tpkit.context_parallel` for this setup, on its cp communicator (None: cp 1)."""
        return {"method": self.setup.cp_method} if self.setup.cp > 1 else None

    def data_parallel_kwargs(self) -> dict[str, Any] | None:
        """Keyword arguments of `tpkit.data_parallel` (None: no data parallel wrapper; replicas run alone)."""
        return {"mode": self.setup.dp_mode} if self.setup.dp_mode in ("ddp", "fsdp") else None


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """Every candidate, best first (fitting ones by measured time when measured, else predicted)."""

    goal: str
    devices: int
    batch_size: int
    seq_len: int
    memory_per_device: float | None
    candidates: tuple[Candidate, ...]
    notes: tuple[str, ...] = ()

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]

    @property
    def tied(self) -> list[Candidate]:
        """The fitting setups other than the best whose time is within `NOISE` of its (measured when the best was
        measured, else predicted): the estimate cannot tell them apart."""
        b = self.best
        if b.measured_s is not None:
            return [c for c in self.fitting[1:]
                    if c.measured_s is not None and inseparable(b.runs, c.runs, NOISE)]
        return [c for c in self.fitting[1:] if c.prediction.seconds <= b.prediction.seconds * (1 + NOISE)]

    @property
    def table(self) -> str:
        return self.summary()

    def summary(self, width: int | None = None) -> str:
        """The candidates as a table (fitted to `width` columns; None: natural width)."""
        unit = "ms/token" if self.goal == "decode" else "ms/step"
        measured = any(c.measured_s is not None for c in self.candidates)
        columns = [Column("#"), Column("setup", "left", wrap="words"), Column(f"predicted {unit}"),
                   *([Column(f"measured {unit}")] if measured else []), Column("memory/device"),
                   Column("kernels", drop=3), Column("op overhead", drop=2), Column("comm", drop=1),
                   Column("fits", "left")]
        rows = []
        for i, c in enumerate(self.candidates, 1):
            p = c.prediction
            rows.append([str(i), c.setup.label(), f"{p.seconds * 1e3:.2f}",
                         *([runs_text(c.runs) if c.measured_s is not None else ""] if measured else []),
                         format_bytes(p.memory_bytes), f"{p.kernels_s * 1e3:.2f}", f"{p.overhead_s * 1e3:.2f}",
                         f"{_comm_s(p) * 1e3:.2f}",
                         "yes" if c.fits else "no"])
        cap = format_bytes(self.memory_per_device) if self.memory_per_device else "no cap"
        title = (f"setups for {self.goal} on {self.devices} devices (batch {self.batch_size}, seq {self.seq_len}, "
                 f"memory {cap})")
        return render_table(title, columns, rows, width)

    def explain(self, width: int | None = None) -> str:
        """Why the best setup won: its time's parts, what the runner-up and the dropped setups cost."""
        b = self.best
        p = b.prediction
        lines = [f"best: {b.setup.label()}: {p.seconds * 1e3:.2f} ms predicted"
                 + (f", {b.measured_s * 1e3:.2f} ms measured" if b.measured_s is not None else "")
                 + f" ({p.kernels_s * 1e3:.2f} ms kernels, {p.overhead_s * 1e3:.2f} ms fixed cost of {p.ops} ops, "
                   f"{_comm_s(p) * 1e3:.2f} ms in {p.collectives} tensor-parallel "
                 + ("and context-parallel " if b.setup.cp > 1 else "") + ("and expert-parallel " if b.ep > 1 else "")
                 + f"collectives and data parallelism); {format_bytes(p.memory_bytes)} per device"]
        if len(self.fitting) > 1:
            r = self.fitting[1]
            lines.append(f"runner-up: {r.setup.label()}: {r.prediction.seconds * 1e3:.2f} ms "
                         f"({r.prediction.seconds / max(p.seconds, 1e-12):.2f}x)")
        if self.tied:
            launches = len(b.runs)
            what = (f"whose {launches} launches overlap the best's ({runs_text(b.runs)} ms)" if launches > 1
                    else f"{'measured' if b.measured_s is not None else 'predicted'} within {NOISE:.0%} of the best")
            lines.append(f"a tie: {len(self.tied)} other setup(s) {what} ("
                         + "; ".join(c.setup.label() for c in self.tied[:3]) + (" ..." if len(self.tied) > 3 else "")
                         + ("): the launches cannot separate them" if launches > 1 else
                            "), within the estimate's own error") + ": either will do"
                         + ("" if b.measured_s is not None else f"; `search --measure {len(self.tied) + 1}` runs them"
                                                                 f" to choose"))
        dropped = [c for c in self.candidates if not c.fits]
        if dropped:
            lines.append(f"{len(dropped)} setups do not fit {format_bytes(self.memory_per_device)} per device; the "
                         f"smallest of them needs {format_bytes(min(c.prediction.memory_bytes for c in dropped))}")
        lines += list(self.notes)
        return "\n".join(wrap_text(line, width, "", "  ") for line in lines)

    def plan_for(self, model, candidate: Candidate | None = None):
        """The plan to pass `parallelize` / `from_pretrained` for `candidate` (default the best) on `model`."""
        c = candidate or self.best
        mode = "training" if self.goal == "train" else "inference"
        return propose(analyze_structure(model), c.setup.tp, mode, c.setup.choose())[0]

    def plot(self, path: str) -> str:
        """A picture of the candidates: predicted time against memory per device (matplotlib); returns `path`."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for c in self.candidates:
            ax.scatter(c.prediction.memory_bytes / 2 ** 20, c.prediction.seconds * 1e3,
                       color="tab:blue" if c.fits else "tab:gray", marker="o" if c.fits else "x")
        best = self.best.prediction
        ax.scatter(best.memory_bytes / 2 ** 20, best.seconds * 1e3, s=160, facecolors="none", edgecolors="tab:red",
                   label=f"best: {self.best.setup.label()}")
        if self.memory_per_device:
            ax.axvline(self.memory_per_device / 2 ** 20, color="tab:red", linestyle="--", label="memory cap")
        ax.set_xlabel("memory per device (MiB)")
        ax.set_ylabel("predicted " + ("ms/token" if self.goal == "decode" else "ms/step"))
        ax.set_title(f"{self.goal} on {self.devices} devices")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path

    def to_dict(self) -> dict[str, Any]:
        return {"goal": self.goal, "devices": self.devices, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "memory_per_device": self.memory_per_device, "notes": list(self.notes),
                "tied": [c.setup.label() for c in self.tied],
                "candidates": [{**c.prediction.to_dict(), "fits": c.fits, "measured_s": c.measured_s,
                                "measured_runs": list(c.measured_runs)} for c in self.candidates]}


def _comm_s(p: Prediction) -> float:
    return p.tp_communication_s + p.dp_communication_s + p.cp_communication_s + p.ep_communication_s


def family_alternatives(model, tp: int, goal: str) -> list[tuple[str, str]]:
    """(family, alternative) pairs a plan at `tp` offers besides the defaults (one entry per pair)."""
    mode = "training" if goal == "train" else "inference"
    _, proposals = propose(analyze_structure(model), tp, mode)
    out: list[tuple[str, str]] = []
    for p in proposals:
        if p.family == "sequence_parallel":
            continue  # a setup option of its own
        for c in p.choices[1:]:
            if (p.family, c.label) not in out:
                out.append((p.family, c.label))
    return out


def candidates(model, devices: int, goal: str, alternatives: bool = True, layers: int | None = None,
               batch_size: int = 1, context: bool = False, experts: int = 0) -> list[Setup]:
    """Every setup tpkit can build for `goal` on `devices` devices (see the module docstring); without
    `alternatives`, only the TP / DP (/ CP / EP) layouts with the families' defaults, no sequence parallel, no
    recompute. For training, pipeline stages too (`pipeline_candidates`: a model of `layers` blocks), with `context`
    (the model's attention can be split over the sequence) context parallelism (`context_candidates`), and for a
    model whose MoE layers hold `experts` experts each, expert parallelism (`expert_candidates`)."""
    out = pipeline_candidates(devices, layers, batch_size) if goal == "train" else []
    out += context_candidates(devices, alternatives) if goal == "train" and context else []
    out += expert_candidates(devices, goal, experts) if experts else []
    for tp in [t for t in range(1, devices + 1) if devices % t == 0]:
        dp = devices // tp
        modes = ([None] if dp == 1 else ["ddp", "fsdp"] if goal == "train" else ["replicas"])
        if not alternatives:
            out += [Setup(tp, dp, mode) for mode in modes]
            continue
        choices = [()] + [((f, label),) for f, label in (family_alternatives(model, tp, goal) if tp > 1 else [])]
        for mode in modes:
            for sp in ([False, True] if goal == "train" and tp > 1 and mode != "fsdp" else [False]):
                for recompute in (("none", "selective", "full") if goal == "train" else ("none",)):
                    out += [Setup(tp, dp, mode, sp, recompute, choice) for choice in choices]
    return out


def pipeline_candidates(devices: int, layers: int | None, batch_size: int) -> list[Setup]:
    """pp x tp x dp layouts with 2 or more stages (at most one per layer), 1F1B, as many micro-batches as divide a
    dp rank's batch up to 4 per stage (more shrink the bubble, smaller ones run slower kernels); families'
    defaults, no sequence parallel, no recompute."""
    out = []
    for pp in [p for p in range(2, devices + 1) if devices % p == 0 and (layers is None or p <= layers)]:
        for tp in [t for t in range(1, devices // pp + 1) if (devices // pp) % t == 0]:
            dp = devices // pp // tp
            local = -(-batch_size // dp)
            m = max(d for d in range(1, min(local, 4 * pp) + 1) if local % d == 0)
            out += [Setup(tp, dp, mode, pp=pp, microbatches=m) for mode in ([None] if dp == 1 else ["ddp", "fsdp"])]
    return out


def context_candidates(devices: int, alternatives: bool = True) -> list[Setup]:
    """tp x dp x cp layouts with cp >= 2 ranks sharing each sequence (training), each attention layer's method as
    `tpkit.context_parallel` picks it ("auto": all-to-all where the local heads divide, else the ring); families'
    defaults, no sequence parallel; FSDP2 over dp x cp (over cp alone at dp 1) or DDP over dp; recompute too with
    `alternatives` (context parallelism, sharding and recompute all buy room for a long sequence: the search weighs
    them against each other)."""
    out = []
    for cp in [c for c in range(2, devices + 1) if devices % c == 0]:
        for tp in [t for t in range(1, devices // cp + 1) if (devices // cp) % t == 0]:
            dp = devices // cp // tp
            for mode in ([None, "fsdp"] if dp == 1 else ["ddp", "fsdp"]):  # FSDP2 shards over dp x cp
                out += [Setup(tp, dp, mode, recompute=r, cp=cp)
                        for r in (("none", "selective", "full") if alternatives else ("none",))]
    return out


def expert_candidates(devices: int, goal: str, num_experts: int) -> list[Setup]:
    """tp x dp layouts with an expert group of ep > 1 ranks for a model whose MoE layers hold `num_experts` experts:
    every ep `tpkit.comm.groups` can carve (a multiple of tp dividing the devices, at most the experts: `valid_eps`),
    TP keeping the experts whole; DDP or FSDP2 over dp for training (the experts reduced over their own expert-data
    group), replicas for inference; families' defaults, no sequence parallel, no recompute."""
    out = []
    for tp in [t for t in range(1, devices + 1) if devices % t == 0]:
        dp = devices // tp
        modes = [None] if dp == 1 else ["ddp", "fsdp"] if goal == "train" else ["replicas"]
        out += [Setup(tp, dp, mode, ep=ep) for ep in valid_eps(tp, devices, num_experts) for mode in modes]
    return out


def _check(devices: int, goal: str, batch_size: int, seq_len: int) -> None:
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"search: devices must be a positive int, got {devices!r}")
    if goal not in GOALS:
        raise ValueError(f"search: goal must be one of {GOALS}, got {goal!r}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"search: batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")


def search(model_or_config, devices: int, goal: str = "decode", memory_per_device: float | None = None,
           batch_size: int = 1, seq_len: int = 128, profile: SpeedProfile | str | None = None, measure: int = 0,
           runner: Runner | None = None, dtype: torch.dtype | None = None, alternatives: bool = True,
           hardware=None, context: bool = True, experts: bool = True, launches: int = 1) -> SearchResult:
    """Rank every setup of `model_or_config` on `devices` devices for `goal` (see the module docstring).

    `memory_per_device`: bytes (drops setups that need more; ValueError naming the smallest need when none
    fits); `profile`: a measured speed profile (`tpkit estimate --calibrate`); `measure=K` with a `runner`: run
    the top K, each `launches` times taking turns (`measured.py`), and rank them by their median; `alternatives=False`: the TP / DP layouts only (see `candidates`);
    `hardware`: a `Hardware` to price on when the profile was not measured op by op. `context`: training setups
    include context parallelism (`context_candidates`) when the model's attention can be split over the sequence
    (`context.context_refusal`, tpkit.context's own checks; the notes say why not); False leaves it out. `experts`:
    a model with fused experts is offered expert parallelism too (`expert_candidates`); False leaves it out."""
    _check(devices, goal, batch_size, seq_len)
    profile = profile if isinstance(profile, SpeedProfile) else load_profile(profile)
    model = _weightless(model_or_config)
    traces: dict[tuple, Any] = {}
    preds, unbuildable = [], {}
    layers = getattr(getattr(model_or_config, "config", model_or_config), "num_hidden_layers", None)
    refused = context_refusal(model) if context and goal == "train" else None
    moe = expert_layers(model) if experts else None
    setups = candidates(model, devices, goal, alternatives, layers if isinstance(layers, int) else None, batch_size,
                        context and goal == "train" and refused is None,
                        moe.num_experts if isinstance(moe, ExpertLayers) else 0)
    for s in setups:
        key = (s.dp, split_of(s))  # DP mode, recompute: the same trace
        if key not in traces:
            try:
                traces[key] = trace_setup(model_or_config, s, goal, batch_size, seq_len, dtype=dtype)
            except PlanError as exc:  # e.g. sequence parallelism around attention kept whole
                traces[key] = None
                unbuildable[s.label()] = str(exc)
        if traces[key] is not None:
            preds.append(predict(model_or_config, s, goal, batch_size, seq_len, profile, traced=traces[key],
                                 hardware=hardware))
    fits = [memory_per_device is None or p.memory_bytes <= memory_per_device for p in preds]
    if not any(fits):
        smallest = min(preds, key=lambda p: p.memory_bytes)
        raise ValueError(f"search: no setup fits {format_bytes(memory_per_device)} per device; the smallest, "
                         f"{smallest.setup.label()}, needs {format_bytes(smallest.memory_bytes)} for {goal} at batch "
                         f"{batch_size} x seq {seq_len}: raise the cap, add devices or shrink the batch")
    ranked = sorted((Candidate(p, f) for p, f in zip(preds, fits)), key=lambda c: (not c.fits, c.prediction.seconds))
    notes = [f"predicted with profile {profile.name!r} ("
             + (f"measured op by op, {devices} ranks sharing the machine)" if profile.machine else
                "no op-level calibration: datasheet peaks scaled by the profile; `tpkit estimate --calibrate` on the "
                "machine that will run it measures it)")]
    notes += [f"cannot be built: {label}: {why}" for label, why in unbuildable.items()]
    notes += [f"no context parallelism: {refused}"] if refused else []
    notes += [_context_note(devices)] if any(s.cp > 1 for s in setups) else []
    notes += [EXPERTS_NOTE] if any(s.ep > 1 for s in setups) else []
    if measure:
        if runner is None:
            raise ValueError("search: measure=K runs setups on real ranks; call tpkit.search, which provides them")
        ranked = _measured(ranked, measure, launches, runner, model_or_config, goal, batch_size, seq_len)
        notes.append(f"the top {measure} were run on {devices} ranks and ranked by their measured time"
                     + (f" (the median of {launches} launches each, taking turns)" if launches > 1 else ""))
    ranked[0] = dataclasses.replace(ranked[0], plan=_plan(model_or_config, ranked[0].setup, goal, dtype))
    return SearchResult(goal, devices, batch_size, seq_len, memory_per_device, tuple(ranked), tuple(notes))


def _context_note(devices: int) -> str:
    return (f"context parallelism: cp ranks share each sequence (zigzag halves, padded to a multiple of 2 x cp), "
            f"traced at a rank's share; attention kernels counted cp times, its all-to-alls (or ring sends) and one "
            f"all-reduce over cp per parameter priced on the {devices} devices' rates")


def _plan(model_or_config, setup: Setup, goal: str, dtype):
    """The plan of `setup` for the whole model (a config is built on the meta device at full depth)."""
    if isinstance(model_or_config, nn.Module):
        model = meta_copy(model_or_config)
    else:
        layers = getattr(model_or_config, "num_hidden_layers", None)
        model = with_layers(model_or_config, None, layers, dtype or torch.bfloat16)
    mode = "training" if goal == "train" else "inference"
    return propose(analyze_structure(model), setup.tp, mode, setup.choose())[0]


def _measured(ranked: list[Candidate], k: int, launches: int, runner: Runner, model, goal: str, batch: int,
              seq: int) -> list[Candidate]:
    # only the top k run (each run is a set of processes for several steps: every fitting setup of a 100M model
    # took over 400 s before this slice came first)
    top = [c for c in ranked if c.fits][:k]
    runs = run_alternating(len(top), launches, lambda i: runner(model, top[i].setup, goal, batch, seq))
    top = [dataclasses.replace(c, measured_s=median(r), measured_runs=r) for c, r in zip(top, runs)]
    top.sort(key=lambda c: c.measured_s)
    chosen = {id(c.prediction) for c in top}
    return top + [c for c in ranked if id(c.prediction) not in chosen]


def _weightless(model_or_config) -> nn.Module:
    """A model to read the families' alternatives from (a config is built on the meta device, two layers)."""
    if isinstance(model_or_config, nn.Module):
        return meta_copy(model_or_config)
    layers = min(2, getattr(model_or_config, "num_hidden_layers", 2) or 2)
    return with_layers(model_or_config, None, layers, torch.float32)
