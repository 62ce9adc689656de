"""Setups run for real: `run_setup` times a few steps of one setup on local ranks, and `search` is the setup
search with that runner, so `measure=K` ranks the top K by what they really take; `analyze` is
`tpkit.convert.analyze` whose suggested world size comes from the search, with a transformer's training
activations by sequence length and context parallelism.

This module sits above `tpkit.estimate` (with `data_parallel` and `recompute`) because a real run builds what
the estimate only prices: the converted model, context parallelism, recompute, DDP or FSDP2 over the
data-parallel group.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import time
from typing import Any

import torch
from torch import nn

from .comm.rank_groups import groups, split
from .context import context_parallel
from .convert import parallelize
from .convert.advice.analyze import AnalysisReport, detected_device_memory, parse_bytes
from .convert.advice.analyze import analyze as analyze_plan
from .convert.planning.planner import propose
from .convert.trace import analyze_structure
from .data_parallel import data_parallel
from .experts import expert_parallel
from .distributed import get_communicator
from .estimate.framework import generate_token_seconds
from .estimate.hardware import detect_hardware
from .estimate.config import attention_kind, own_dtype, resolve_target
from .estimate.context import context_refusal
from .estimate.experts import expert_layers, expert_memory
from .estimate.setup import Setup
from .estimate.pricing import NotPriced, machine_pricing
from .estimate.quantized import loaded_dtype
from .estimate.search import SearchResult
from .estimate.search import search as rank_setups
from .estimate.sequences import sequence_memory
from .launch import launch
from .nn.decode import adopt_decode_paths
from .pipeline import Pipeline, pipeline
from .recompute import recompute
from .tables import format_bytes as human


def _build(model_or_config, dtype: torch.dtype | None) -> nn.Module:
    """A model to run: a copy of the module, or the config's model with weights from a fixed seed (float32
    unless `dtype` says otherwise: the CPU's own type)."""
    if isinstance(model_or_config, nn.Module):
        model = copy.deepcopy(model_or_config)
        return model.to(dtype) if dtype is not None else model
    import transformers as tr

    torch.manual_seed(0)
    return tr.AutoModelForCausalLM.from_config(model_or_config).to(dtype or torch.float32)


def apply_setup(model: nn.Module, setup: Any, comm=None, goal: str | None = None, plan: Any = None) -> nn.Module:
    """Run `model` under a setup (the search's `result.best`, or a `Setup`) on `comm`'s ranks (default the world):
    split them into tp x dp groups (pp x dp x cp x tp with context or expert parallelism, `tpkit.comm.groups`),
    convert with the setup's plan, make it context-parallel over its cp group, spread its experts over its expert
    group (`tpkit.expert_parallel`; the plan keeps them whole), recompute, wrap in DDP / FSDP2. `goal` (a
    candidate knows its own; default "train") decides training or inference mode. Returns the model to use; for a
    setup with pipeline stages (`pp > 1`), the `tpkit.Pipeline` (`tpkit.pipeline`: train with `.step`)."""
    comm = comm or get_communicator()
    if hasattr(setup, "prediction"):  # a search candidate
        goal, plan = goal or setup.prediction.goal, plan if plan is not None else setup.plan
        setup = setup.setup
    goal = goal or "train"
    if setup.devices != comm.world_size:
        raise ValueError(f"apply_setup: {setup.label()} needs {setup.devices} ranks, the communicator has "
                         f"{comm.world_size}")
    mode = "training" if goal == "train" else "inference"
    cp, ep = getattr(setup, "cp", 1), getattr(setup, "ep", 1)
    if getattr(setup, "pp", 1) > 1:  # stages: a `tpkit.Pipeline` (its `.model` is this rank's part)
        return pipeline(model, comm, pp=setup.pp, tp=setup.tp, cp=cp, cp_method=getattr(setup, "cp_method", "auto"),
                        schedule=setup.schedule, microbatches=setup.microbatches,
                        stages_per_rank=setup.stages_per_rank, dp_mode=setup.dp_mode or "fsdp", mode=mode)
    if cp > 1 or ep > 1:  # FSDP2 shards over every rank holding the same weights (dp x cp), DDP averages over dp
        laid = groups(comm, tp=setup.tp, cp=cp, ep=ep)
        engine = laid.dp_cp if setup.dp_mode == "fsdp" else laid.dp
        tp, dp = laid.tp, engine if engine.world_size > 1 else None
    else:
        tp, dp = split(comm, setup.tp) if setup.dp > 1 else (comm, None)
    if setup.tp > 1:
        plan = plan if plan is not None else propose(analyze_structure(model), setup.tp, mode, setup.choose())[0]
        model = parallelize(model, plan, tp, mode=mode, sequence_parallel=setup.sequence_parallel)
    else:  # nothing split: its Linear layers multiply at decode as a conversion's do (and as the estimate prices)
        adopt_decode_paths(model)
    if cp > 1:  # after conversion (`tpkit.context`): gradients summed over cp, then DDP averages over dp (FSDP2: dp x cp)
        context_parallel(model, laid.cp, method=setup.cp_method)
    if ep > 1:  # each rank keeps its experts of the expert group; the engines below leave them alone
        expert_parallel(model, laid)
    if goal == "train" and setup.recompute != "none":
        recompute(model, setup.recompute)
    if goal == "train" and dp is not None and setup.dp_mode in ("ddp", "fsdp"):
        model = data_parallel(model, dp, mode=setup.dp_mode)
    return model


def ddp_wrapper(model: nn.Module, comm) -> nn.Module:
    """`model` under torch's DDP over `comm` (the calibration times the framework through it)."""
    return data_parallel(model, comm, mode="ddp")


def fsdp_wrapper(model: nn.Module, comm) -> nn.Module:
    """`model` under torch's FSDP2 over `comm`, its blocks wrapped as `data_parallel` wraps them."""
    return data_parallel(model, comm, mode="fsdp")


# what the calibration measures data parallelism's framework time through (it lives below data_parallel)
DP_WRAPPERS = {"ddp": ddp_wrapper, "fsdp": fsdp_wrapper}


def _median_seconds(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(model_or_config, setup: Setup, goal: str, batch: int, seq: int, steps: int, threads: int,
          dtype: torch.dtype | None, plan: Any = None) -> float:
    torch.set_num_threads(threads)
    comm = get_communicator()
    model = apply_setup(_build(model_or_config, dtype), setup, comm, goal, plan)
    pipe, model = (model, model.model) if isinstance(model, Pipeline) else (None, model)
    local = -(-batch // setup.dp)
    vocab = getattr(getattr(model, "config", None), "vocab_size", 100)
    dp_rank = comm.rank // (setup.tp * setup.cp) % setup.dp  # the ranks of one pipeline, tp and cp group: one batch
    ids = torch.randint(3, vocab, (local, seq), generator=torch.Generator().manual_seed(dp_rank))
    if goal == "train":
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step():
            if pipe is not None:
                pipe.step(ids, ids)
            else:
                model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif goal == "prefill":
        model.eval()

        def step():
            with torch.no_grad():
                model(input_ids=ids)
    else:  # per token of greedy generate, as users decode (and as the calibration measures the framework)
        return generate_token_seconds(model, seq, steps, comm, batch=local, pick=statistics.median)
    comm.barrier()
    seconds = _median_seconds(step, 2, steps)
    return seconds


def run_setup(model_or_config, setup: Setup, goal: str, batch_size: int, seq_len: int, steps: int = 5,
              backend: str = "gloo", threads: int | None = None, dtype: torch.dtype | None = None,
              timeout: float | None = None, plan: Any = None) -> float:
    """Median seconds per step (train, prefill) or per token (decode) of `setup`, the slowest rank's, on
    `setup.devices` local ranks (`threads` each; default the cores shared out over the ranks). `timeout`: seconds
    for the whole run, after which its processes are ended (`tpkit.launch`). `plan`: what `apply_setup` converts
    with (default the setup's own, as the search proposes it; "auto": `parallelize`'s)."""
    threads = threads or max(1, (os.cpu_count() or 1) // setup.devices)
    return max(launch(_rank, setup.devices, backend=backend, timeout=timeout,
                      args=(model_or_config, setup, goal, batch_size, seq_len, steps, threads, dtype, plan)))


def search(model_or_config, devices: int, goal: str = "decode", memory_per_device: Any = None, batch_size: int = 1,
           seq_len: int = 128, profile=None, measure: int = 0, steps: int = 5, backend: str = "gloo",
           dtype: torch.dtype | None = None, hardware=None, progress=None,
           timeout: float | None = None, launches: int = 3) -> SearchResult:
    """The best setup to run `model_or_config` on `devices` devices for `goal` ("decode", "prefill", "train"):
    every setup tpkit can build (TP size, DDP / FSDP2 / replicas over the rest, sequence parallelism, recompute,
    each architecture family's alternatives), priced on this machine by a measured profile (`tpkit estimate
    --calibrate`), those that need more than `memory_per_device` ("80GB", bytes) dropped, the rest ranked; with
    `measure=K` the top K run `steps` steps on local ranks, each in `launches` fresh launches taking turns, and the
    best median wins; setups whose launches overlap the best's are reported as a tie (`SearchResult.tied`). `dtype`: the weights'
    (default: a quantized checkpoint's config its own, as `from_pretrained` loads it; a config's bfloat16 on a
    datasheet machine, float32 on a measured one; a module's own). The machine
    priced is `tpkit.estimate.pricing.machine_pricing(profile, hardware)`'s, as `tpkit estimate`'s: with no
    profile and no GPU of a known kind, this machine is measured first. `progress(text)` is told of each measured
    setup before and after it runs; `timeout`: seconds per measured setup. See `SearchResult`."""
    memory = parse_bytes(memory_per_device) if memory_per_device is not None else None
    pricing = machine_pricing(profile, hardware, dp_wrappers=DP_WRAPPERS)
    if dtype is None and not isinstance(model_or_config, nn.Module):  # what a CPU runs a config's model in (`_build`),
        dtype = loaded_dtype(model_or_config, torch.float32 if pricing.measured else None)  # a quantized one its own
    counter = iter(range(1, max(measure * launches, 1) + 1))

    def runner(model, setup: Setup, goal_: str, batch: int, seq: int) -> float:
        i = next(counter)
        if progress is not None:
            progress(f"measuring {i}/{measure * launches}: {setup.label()} on {setup.devices} {backend} ranks, "
                     f"{steps} steps ...")
        began = time.perf_counter()
        seconds = run_setup(model, setup, goal_, batch, seq, steps, backend, dtype=dtype, timeout=timeout)
        if progress is not None:
            progress(f"measured {i}/{measure * launches}: {setup.label()}: {seconds * 1e3:.2f} ms per "
                     f"{'token' if goal_ == 'decode' else 'step'} ({time.perf_counter() - began:.0f} s)")
        return seconds
    result = rank_setups(model_or_config, devices, goal, memory, batch_size, seq_len, pricing.profile, measure,
                         runner if measure else None, dtype, hardware=pricing.hardware, launches=launches)
    notes = [pricing.origin] + [n for n in result.notes if not n.startswith("predicted with profile")]
    notes += [result.best.prediction.quantized] if result.best.prediction.quantized else []  # priced as it runs
    if pricing.this_machine and devices > pricing.devices:
        notes.append(f"{devices} devices exceed this machine's {pricing.devices} {pricing.device_kind}: the ranking "
                     f"is for a larger machine like this one")
    return dataclasses.replace(result, notes=tuple(notes))


def detected_hardware():
    """The hardware preset of the first CUDA device, when its name says which (A100, H100, H200); else None."""
    return detect_hardware()


def search_advisor(profile=None, batch_size: int = 1, seq_len: int = 128, hardware=None, devices: int | None = None,
                   device_memory: Any = None, calibrate: bool = True):
    """An `analyze` advisor: the world size whose best setup is predicted fastest (the fewest devices within 5% of
    it), among those that fit `device_memory` (default the detected GPU's, else this host's memory: the suggestion
    names the budget it assumed) and that this machine has (`devices`, default its GPUs, else its cores; larger
    sizes are shown, said to be for another machine); priced by `machine_pricing(profile, hardware)` as `tpkit
    estimate` and `tpkit search` are. `calibrate=False`: where nothing prices this machine (no profile, no GPU of a
    known kind), the memory rule suggests instead of a quick calibration (minutes on a small CPU host)."""
    def advise(model: nn.Module, sizes: list[int], mode: str, memory: int | None):
        try:
            pricing = machine_pricing(profile, hardware, calibrate=calibrate, dp_wrappers=DP_WRAPPERS)
        except NotPriced:  # not measured and not asked to measure: the memory rule, which names its budget
            return None
        present = devices or (pricing.devices if pricing.this_machine else max(sizes))
        goal = "decode" if mode == "inference" else "train"
        dtype = loaded_dtype(getattr(model, "config", None), torch.float32 if pricing.measured else None)
        best = {}
        for w in sizes:
            try:
                best[w] = rank_setups(model, w, goal, memory, batch_size, seq_len, pricing.profile,
                                      alternatives=False, hardware=pricing.hardware, dtype=dtype).best
            except ValueError:  # nothing fits at this size
                continue
            except (TypeError, RuntimeError):  # a module the search cannot run without its example: memory rule
                return None
        here = {n: c for n, c in best.items() if n <= present}
        if not here:
            return None
        fastest = min(c.prediction.seconds for c in here.values())
        w = min(n for n, c in here.items() if c.prediction.seconds <= 1.05 * fastest)
        unit = "ms/token" if goal == "decode" else "ms/step"
        others = "; ".join(f"{n}: {c.prediction.seconds * 1e3:.2f}" + (" (for another machine)" if n > present else "")
                           for n, c in sorted(best.items()) if n != w)
        kind = pricing.device_kind if pricing.this_machine and not devices else "devices"
        return w, (f"suggested world size: {w} of the {present} {kind} here ({pricing.origin}; setup search, batch "
                   f"{batch_size} x seq {seq_len}: {best[w].setup.label()} predicted "
                   f"{best[w].prediction.seconds * 1e3:.2f} {unit}"
                   + (f"; other sizes {others} {unit}" if others else "") + "; `tpkit search` shows every setup); "
                   + _budget_line(memory, device_memory, best[w].prediction.memory_bytes, best[w].setup.label()))
    return advise


def _budget_line(budget: int | None, device_memory: Any, needed: int, label: str) -> str:
    """The memory budget per device a suggestion assumed (`budget`, what `tpkit.convert.analyze` passed the advisor)
    and where it comes from: given, the detected GPU's, else this host's memory, said so (a CPU host has no device
    memory of its own); with what the suggested setup needs of it."""
    if budget is None:
        return ("no memory budget: no GPU detected, no device_memory given and this host's memory is unknown; pass "
                "device_memory='80GB' (CLI: --device-memory 80GB)")
    where = ("as given" if device_memory is not None else "the detected GPU's" if detected_device_memory() is not None
             else "host memory (no GPU detected and no device_memory given; assumed as one device's budget: pass "
                  "device_memory='80GB' for GPUs, CLI: --device-memory 80GB)")
    return f"memory budget {human(budget)} per device: {where}; {label} needs {human(needed)} per device"


def analyze(model: nn.Module, world_size: int | None = None, max_world_size: int = 8, device_memory: Any = None,
            mode: str = "inference", example_inputs: Any = None, profile=None, batch_size: int = 1,
            seq_len: int = 128, devices_per_node: int | None = None, hardware=None,
            calibrate: bool = True) -> AnalysisReport:
    """`tpkit.convert.analyze` (which layers split, memory per rank, recommendations) with the world size
    suggested by the setup search on the machine `machine_pricing(profile, hardware)` prices (the one `tpkit
    estimate` and `tpkit search` price): never more devices than one machine holds (`devices_per_node`, default
    this machine's GPUs, else its cores) unless priced for another machine (`hardware`). With no profile and no GPU
    of a known kind this machine is measured first (a quick calibration, written for the next call), unless
    `calibrate=False`: then the memory rule suggests (as the demo does). In training mode a transformer's report
    also shows its activations per rank by sequence length and context parallelism, and the longest sequence that
    fits the budget at each cp (`sequence_table`). A model with fused experts also gets its expert memory per rank
    by expert parallelism (`expert_table`)."""
    report = analyze_plan(model, world_size, max_world_size, device_memory, mode, example_inputs,
                          advisor=search_advisor(profile, batch_size, seq_len, hardware, devices_per_node,
                                                 device_memory, calibrate),
                          devices_per_node=devices_per_node)
    report.sequences = sequence_table(model, report, batch_size)
    report.experts = expert_table(model, report)
    return report


def expert_table(model: nn.Module, report: AnalysisReport):
    """Expert memory per rank by ep at the report's TP size beside the rest it counted
    (`tpkit.estimate.experts.ExpertMemory`), for a model with fused experts; None for any other."""
    layers = expert_layers(model)
    if isinstance(layers, str):
        return None
    t = report.world_size
    return expert_memory(layers, t, report.mode, report.per_rank_memory[t], report.device_memory)


def sequence_table(model: nn.Module, report: AnalysisReport, batch_size: int = 1, cps=(1, 2, 4, 8)):
    """Training activations per rank by sequence length at the report's TP size for each cp in `cps`, and the
    longest sequence that fits the report's budget beside the weights, gradients and AdamW states it counted
    (`tpkit.estimate.sequences.SequenceMemory`); cp 1 alone, saying why, for a model whose attention cannot be
    split over the sequence; None outside training or for a model whose shape the estimates do not model."""
    if report.mode != "training":
        return None
    try:
        config, shape = resolve_target(model, "analyze")
    except (TypeError, ValueError):
        return None
    if shape is None:
        return None
    refused = context_refusal(model)
    dtype = own_dtype(model)
    tp = report.world_size
    return sequence_memory(shape, dtype.itemsize, tp, (1,) if refused else cps, batch_size=batch_size,
                           budget=report.device_memory, held=report.per_rank_memory[tp],
                           attention=attention_kind(config, None),
                           max_positions=getattr(config, "max_position_embeddings", None),
                           dtype=str(dtype).replace("torch.", ""),
                           notes=(f"no context parallelism: {refused}",) if refused else ())
