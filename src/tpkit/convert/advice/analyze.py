"""`analyze(model)`: which layers split and how, what stays replicated and why, memory per rank, and the
smallest world size that fits a device.

Figures are exact parameter bytes from the plan the planner would apply (the same shard shapes
`parallelize` builds); "training" adds gradients and AdamW's two fp32 states per parameter. Activations and
the KV cache are not counted here (see `tpkit.estimate.estimate_memory`); `tpkit.analyze` adds a transformer's
training activations by sequence length and context parallelism (`AnalysisReport.sequences`).
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable

import torch
from torch import nn

from ...tables import format_bytes as human
from ..peft.adapters import adapter_memory, adapter_tensors, bare_model, peft_layers
from ..modules import kind
from .multinode import local_device_count, multi_node_advice
from ..quantized import held_weight_bytes, model_quantization, quantized_note, scheme_of, with_units
from ..planning.decide import plan as plan_for
from .recommend import recommendations
from ..registry import module_layouts
from ..styles import REPLICATE
from ..trace import Analysis, analyze_structure

# Binary throughout: device memory is sold in binary units under decimal names (an "80GB" H100 holds 80 GiB).
UNITS = {"b": 1, **{f"{p}{suffix}": 2 ** (10 * (i + 1)) for i, p in enumerate("kmgt") for suffix in ("", "b", "ib")}}


def parse_bytes(value: Any) -> int | None:
    """A device memory size -> bytes: `80GB`, `80 GiB`, `80G`, `1.5e9` or an int (None stays None).

    KB/MB/GB/TB (and K/M/G/T) mean the same as KiB/MiB/GiB/TiB, powers of 2**10: GPU memory is marketed that
    way ("80GB" A100/H100 = 80 * 2**30 bytes), and reading it as 80e9 would under-count a device by 7%.
    A plain number is a byte count."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in UNITS | {"": 1}:
        raise ValueError(f"cannot read a memory size from {value!r}; write e.g. '80GB', '24GiB' or a byte count")
    return int(float(m.group(1)) * UNITS.get(m.group(2).lower(), 1))


def detected_device_memory() -> int | None:
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return None


@dataclasses.dataclass
class LayerReport:
    """One parameterised layer: what it is, what it weighs, and what the plan does with it."""

    name: str
    type: str
    shape: tuple
    params: int
    bytes: int
    style: str
    reason: str
    bytes_per_rank: int  # on the rank holding the most of this layer
    tied_to: str | None = None


@dataclasses.dataclass
class AnalysisReport:
    """The analysis: per layer rows, totals and per-rank memory (see `summary()` and `to_dict()`)."""

    model_name: str
    layers: list[LayerReport]
    world_size: int
    mode: str
    total_params: int
    total_bytes: int
    parallelizable_bytes: int
    per_rank_bytes: dict[int, int]        # world size -> parameter bytes on the fullest rank
    per_rank_memory: dict[int, int]       # world size -> bytes for `mode` (training adds grads + AdamW)
    device_memory: int | None
    suggested_world_size: int | None
    suggestion: str
    recommendations: list[str]
    plan: Any
    trace_error: str | None = None
    # training activations by sequence length and context parallelism, with `.summary(width)` and `.to_dict()`
    # (`tpkit.estimate.sequences.SequenceMemory`: `tpkit.analyze` adds it for a transformer in training mode)
    sequences: Any = None
    # expert memory per rank by expert parallelism, with `.summary(width)` and `.to_dict()` (`tpkit.estimate.experts.
    # ExpertMemory`: `tpkit.analyze` adds it for a model with fused experts)
    experts: Any = None

    @property
    def parallelizable_percent(self) -> float:
        return 100.0 * self.parallelizable_bytes / max(self.total_bytes, 1)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["plan"] = self.plan.to_dict()
        d["parallelizable_percent"] = self.parallelizable_percent
        d["layers"] = [dict(dataclasses.asdict(r), shape=list(r.shape)) for r in self.layers]
        d["per_rank_bytes"] = {str(k): v for k, v in self.per_rank_bytes.items()}
        d["per_rank_memory"] = {str(k): v for k, v in self.per_rank_memory.items()}
        d["sequences"] = self.sequences.to_dict() if self.sequences is not None else None
        d["experts"] = self.experts.to_dict() if self.experts is not None else None
        return d

    def grouped_layers(self) -> list[tuple[str, int, LayerReport]]:
        """Rows with layer numbers folded into `*` when every numbered layer agrees (for long models)."""
        groups: dict[tuple, list[LayerReport]] = {}
        for r in self.layers:
            key = (re.sub(r"\.\d+\.", ".*.", r.name), r.type, r.shape, r.style, r.reason, r.bytes_per_rank)
            groups.setdefault(key, []).append(r)
        return [(key[0], len(rows), rows[0]) for key, rows in groups.items()]

    def summary(self, width: int | None = None) -> str:
        """The tables and advice as text. `width=None` (default) never wraps a cell: every column at its natural
        width, for files and pipes. A terminal's width (`tpkit.convert.tables.output_width()`) leaves out the least
        important columns first (params, type, weight, bytes), then wraps reasons between words and breaks long
        module names after a dot; no word or number is cut."""
        from ...tables import Column, render_table, wrap_text

        columns = [Column("layer", "left", wrap="names"), Column("type", "left", drop=3), Column("weight", drop=2),
                   Column("params", drop=4), Column("bytes", drop=1), Column(f"per rank @{self.world_size}"),
                   Column("style / reason", "left", wrap="words")]
        rows = []
        for name, count, r in self.grouped_layers():
            how = r.style if r.style != "replicate" else f"replicate: {r.reason}"
            if r.tied_to:
                how += f" (tied to {r.tied_to})"
            rows.append([name if count == 1 else f"{name} (x{count})", r.type, "x".join(map(str, r.shape)),
                         f"{r.params:,}", human(r.bytes), human(r.bytes_per_rank), how])
        memory = [[str(w), human(self.per_rank_bytes[w]), human(self.per_rank_memory[w])]
                  for w in sorted(self.per_rank_bytes)]
        what = "weights" if self.mode == "inference" else "weights + grads + AdamW states"
        parts = [
            render_table(f"{self.model_name}: tensor-parallel plan at world size {self.world_size} ({self.mode})",
                         columns, rows, width),
            wrap_text(f"total: {self.total_params:,} parameters, {human(self.total_bytes)}; parallelizable: "
                      f"{human(self.parallelizable_bytes)} ({self.parallelizable_percent:.1f}%)", width),
            render_table(f"memory per rank ({self.mode}: {what})",
                         [Column("world size"), Column("parameters"), Column(self.mode)], memory, width),
            wrap_text(self.suggestion, width),
        ]
        if self.experts is not None:
            parts.append(self.experts.summary(width))
        if self.sequences is not None:
            parts.append(self.sequences.summary(width))
        if self.recommendations:
            parts.append("recommendations:")
            parts += [wrap_text(rec, width, "  - ", "    ") for rec in self.recommendations]
        return "\n".join(parts) + "\n"

    def __str__(self) -> str:
        return self.summary()


def _unique_params(m: nn.Module, seen: set) -> list[tuple[str, torch.Tensor]]:
    out = []
    for n, p in m.named_parameters(recurse=False):
        if id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out


def _module_bytes(m: nn.Module, params, style: str, details, world: int, scheme=None) -> list[int]:
    """Bytes of `params` (module `m`'s own, not yet counted) that each rank holds under `style`; a weight a
    quantized checkpoint stores (`scheme`) counts what a load holds of it: its stored tensors and what the load
    keeps beside them (`held_weight_bytes`)."""
    out = []
    for rank in range(world):
        layouts = module_layouts(m, style, details, world, rank)
        out.append(sum(held_weight_bytes(scheme, layouts[pname], p.dtype) if scheme and pname == "weight"
                       else layouts[pname].local_numel * p.element_size() for pname, p in params))
        if style == REPLICATE:
            return out * world
    return out


def _planned(a: Analysis, world: int, mode: str, quant) -> Any:
    """The plan `parallelize` makes at `world`: a quantized checkpoint's column / row pairs split their shared
    features in whole groups (`with_units`), as its load does, so the bytes counted are the bytes a rank holds."""
    plan = plan_for(a.model, world, mode=mode, analysis=a)  # `parallelize`'s plan step, on this trace
    return with_units(plan, dict(a.model.named_modules()), quant, world) if quant is not None and world > 1 else plan


def _holders(a: Analysis) -> dict[str, nn.Module]:
    """Every module that holds parameters itself: the planned layers, and containers with parameters of their
    own (nn.MultiheadAttention's in_proj, ViT's class token), so every parameter is counted once: layers
    first, so a parameter a container shares with a layer (BERT's `cls.predictions.bias`) counts as the layer's."""
    others = {n: m for n, m in a.model.named_modules()
              if n not in a.leaves and any(True for _ in m.parameters(recurse=False))}
    return {**a.leaves, **others}


def _rank_bytes(a: Analysis, plan, world: int, quant=None) -> int:
    """Parameter bytes on the fullest rank (usually rank 0, which the split rule gives the remainder; uneven
    GQA layouts can load another rank more, so every rank is counted)."""
    per_rank, seen = [0] * world, set()
    for name, m in _holders(a).items():
        params = _unique_params(m, seen)
        if params:
            b = _module_bytes(m, params, plan.entries.get(name, "replicate"), plan.details.get(name), world,
                              scheme_of(quant, name, m) if quant else None)
            per_rank = [x + y for x, y in zip(per_rank, b)]
    return max(per_rank)


def _training_bytes(a: Analysis, param_bytes: int) -> int:
    """Weights + gradients (same dtype) + AdamW's exp_avg and exp_avg_sq (fp32)."""
    p = next(a.model.parameters(), None)
    elem = p.element_size() if p is not None else 4
    return param_bytes * 2 + (param_bytes // elem) * 8


Advisor = Callable[[nn.Module, list[int], str, "int | None"], "tuple[int, str] | None"]


def analyze(model: nn.Module, world_size: int | None = None, max_world_size: int = 8, device_memory: Any = None,
            mode: str = "inference", example_inputs: Any = None, advisor: Advisor | None = None,
            devices_per_node: int | None = None) -> AnalysisReport:
    """Analyse `model` for tensor parallelism (see the module doc); `world_size` picks the plan shown in the
    table (default: the suggested one, else 2); per-rank memory is given for 1, 2, 4, ... `max_world_size`.

    The suggested world size is the smallest whose weights (and, training, gradients and AdamW states) fit the
    device memory: given, else the detected GPU's, else this host's memory (said so). `advisor(model, sizes,
    mode, device memory)` may suggest instead (`tpkit.analyze` passes the setup search's, which ranks the sizes
    by predicted time); it returns (world size, why) or None to keep the memory rule.

    `devices_per_node` (default: this machine's GPU count, unknown without a GPU) is what one machine holds:
    where the suggestion needs more, the recommendations name the multi-node setup (`convert/advice/multinode.py`)."""
    if mode not in ("inference", "training"):
        raise ValueError(f"analyze: mode must be 'inference' or 'training', got {mode!r}")
    if devices_per_node is not None and (not isinstance(devices_per_node, int) or devices_per_node < 1):
        raise ValueError(f"analyze: devices_per_node must be a positive int (the devices of one machine), got "
                         f"{devices_per_node!r}")
    if peft_layers(model)[1]:  # PEFT LoRA: the bare model's plan, the adapters following their bases
        with bare_model(model) as (target, wrapped):
            report = analyze(target, world_size, max_world_size, device_memory, mode, example_inputs, advisor,
                             devices_per_node)
            memory = adapter_memory(wrapped, target, list(report.per_rank_bytes), mode, example_inputs)
        return _with_adapters(report, wrapped, device_memory, advisor is None, memory)
    quant = model_quantization(model)  # a quantized checkpoint's config: stored bytes, its units named
    a = analyze_structure(model, example_inputs)
    sizes = sorted({w for w in [1, 2, 4, 8, 16, 32, 64, 128, 256] if w <= max_world_size} | {max_world_size}
                   | ({world_size} if world_size else set()))
    plans = {w: _planned(a, w, mode, quant) for w in sizes}
    per_rank = {w: _rank_bytes(a, plans[w], w, quant) for w in sizes}
    memory = {w: per_rank[w] if mode == "inference" else _training_bytes(a, per_rank[w]) for w in sizes}
    dev, source = _budget(device_memory)
    suggested, suggestion = _suggest(memory, dev, source, mode)
    advice = advisor(model, sizes, mode, dev) if advisor is not None else None
    if advice is not None:
        suggested, suggestion = advice
    shown = world_size or suggested or (2 if 2 in plans else sizes[-1])
    plan = plans.get(shown) or _planned(a, shown, mode, quant)
    rows, seen = [], set()
    total_bytes = parallel_bytes = total_params = 0
    for name, m in _holders(a).items():
        params = _unique_params(m, seen)
        tied = a.ties.get(name)
        weight = getattr(m, "weight", None)
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else tuple(next(m.parameters()).shape)
        n = sum(p.numel() for _, p in params)
        style = plan.entries.get(name, "replicate")
        scheme = scheme_of(quant, name, m) if quant else None
        b = _module_bytes(m, params, "replicate", None, 1, scheme)[0] if params else 0
        rb = max(_module_bytes(m, params, style, plan.details.get(name), shown, scheme)) if params else 0
        total_bytes += b
        total_params += n
        if style != "replicate":
            parallel_bytes += b
        why = plan.reasons.get(name, "" if name in a.leaves or style != "replicate" else
                               "holds parameters of its own beside its layers; kept whole")
        rows.append(LayerReport(name, kind(m), shape, n, b, style, why, rb,
                                tied[0] if tied and not params else None))
    report = AnalysisReport(type(model).__name__, rows, shown, mode, total_params, total_bytes, parallel_bytes,
                            per_rank, memory, dev, suggested, suggestion, [], plan, a.trace_error)
    report.recommendations = recommendations(a, plans, plan, shown, report)
    if quant is not None:
        report.recommendations.insert(0, quantized_note(quant))
    node = devices_per_node if devices_per_node is not None else local_device_count()
    advice = multi_node_advice(suggested, memory, dev, node, max_world_size)
    if advice:
        report.recommendations.append(advice)
    return report


def _with_adapters(report: AnalysisReport, wrapped: dict[str, nn.Module], device_memory: Any, resuggest: bool,
                   memory: dict[int, tuple[int, int]]) -> AnalysisReport:
    """`report` (of the bare model) with a row per LoRA tensor, how it is held (`adapters.adapter_tensors`), and
    the memory of LoRA training: the base frozen, gradients and AdamW states for the adapter only (not planned)."""
    for t in adapter_tensors(wrapped, report.plan, report.world_size):
        report.layers.append(LayerReport(t["name"], "LoRA", t["shape"], t["numel"], t["bytes"], f"lora: {t['held']}",
                                         "PEFT adapter: follows its base layer's split", t["rank_bytes"]))
        report.total_params, report.total_bytes = report.total_params + t["numel"], report.total_bytes + t["bytes"]
    for w, (held, trained) in memory.items():
        report.per_rank_bytes[w] += held
        report.per_rank_memory[w] = report.per_rank_bytes[w] + (trained if report.mode == "training" else 0)
    if resuggest:
        report.suggested_world_size, report.suggestion = _suggest(report.per_rank_memory, *_budget(device_memory),
                                                                  report.mode)
    return report


def host_memory() -> int | None:
    """This host's physical memory in bytes (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _budget(device_memory: Any) -> tuple[int | None, str]:
    """(bytes per device, where that figure comes from): given, the detected GPU's, else this host's memory."""
    if device_memory is not None:
        return parse_bytes(device_memory), "given"
    gpu = detected_device_memory()
    if gpu is not None:
        return gpu, "detected GPU's"
    return host_memory(), "host memory (no GPU detected and no device_memory given; assumed as one device's budget:"


def _suggest(memory: dict, dev: int | None, source: str, mode: str) -> tuple[int | None, str]:
    if dev is None:
        return None, ("no GPU detected, no device_memory given and this host's memory is unknown, so no world size is "
                      "suggested; pass device_memory='80GB' (CLI: --device-memory 80GB)")
    budget = (f"the {source} {human(dev)} per device" if not source.startswith("host")
              else f"{human(dev)} of {source} pass device_memory='80GB' for GPUs)")
    for w in sorted(memory):
        if memory[w] <= dev:
            return w, (f"suggested world size: {w} ({human(memory[w])} of {mode} memory per rank fits {budget}; "
                       f"activations not included)")
    w = max(memory)
    return None, (f"no world size up to {w} fits: {human(memory[w])} per rank at {w} ranks exceeds {budget}; raise "
                  f"max_world_size or add pipeline/data parallelism")
