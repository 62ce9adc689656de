"""Time and memory of one setup on the machine at hand, from the plan the converter makes for it.

A `Setup` is how a model runs on `pp x dp x cp x tp` devices: the tensor-parallel size, context parallelism (`cp`
ranks share each training sequence), data parallelism (DDP or FSDP2) over the rest, sequence parallelism,
recompute, the architecture families' alternatives (attention split by heads or whole, the LM head vocab-parallel
or replicated, experts TP or EP), and pipeline stages (`pp`, priced from
the same setup without them by `pipeline.py`: the bubble and the stage sends). `predict` converts a weightless copy
of the model for rank 0 with that setup's plan (`convert.planner.propose` with the setup's choices), traces one
step op by op (`fake_step.trace_step`) and prices it with the rates of `tp x dp` ranks sharing the machine
(`machine.MachineRates`: measured by the calibration, or read off a datasheet by `hardware.datasheet_rates`, which
has no fixed cost per op and ring collectives; one composition for both):

    step = sum over ops (fixed cost per op + max(FLOPs / matmul rate at its rows, bytes / bandwidth)
                         + new pages for its outputs too large for the allocator to keep, `MachineRates.fresh_bandwidth`)
           (a linear layer a quantized checkpoint stores packed: its product as the load runs it, `quantized.py`)
         + every tensor-parallel collective (measured latency + bytes / bandwidth at its group size, plus what a
           collective costs inside a step beyond an isolated call: `MachineRates.collective_overhead_s`)
         + data parallelism's collectives (DDP: gradients all-reduced in 25 MB buckets; FSDP2: each block's
           parameters all-gathered in the forward and again in the backward, its gradients reduce-scattered)
         + context parallelism's (`context.py`): the step is traced at the rank's share of the sequence, its
           attention kernels counted cp times (1/cp of the whole sequence's), plus each attention layer's
           all-to-alls or ring sends and one all-reduce over cp per parameter
         + expert parallelism's (`experts.py`): the step is traced with the rank's experts dispatched as uniform
           routing sends them (times the imbalance), each MoE layer's all-to-alls over ep, and one all-reduce over
           the expert-data group per expert tensor; DDP / FSDP2 leave the expert weights alone

Memory is the most tensor bytes the traced step holds at once (`peak.LiveBytes`: parameters, and what the step's
ops make while it is alive, optimizer states included), moved by what DP, recompute and context parallelism
change; `process_bytes` adds what the machine measured a process holds besides (imports, runtime).

Nothing overlaps: an eager step on a CPU does its ops one after another; on a GPU, tensor-parallel collectives
sit on the critical path. Recompute adds the forward ops again (full) or the attention's (selective). A config
with more than two layers is traced with one and two layers and extrapolated linearly (the layers are identical).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from ..convert.errors import PlanError
from ..convert.planning.planner import propose
from ..convert.registry import generation
from ..convert.trace import analyze_structure
from .activations import context_extra_bytes
from .calls import models_to_trace, trace_source
from .config import attention_kind, own_dtype, transformer_shape
from .context import attention_method, check_priced, context_messages, context_seconds, layer_traffic, local_tokens
from .experts import check_experts, expert_data_seconds, expert_layers
from .fake_step import GOALS, StepTrace, trace_step
from .machine import FRAMEWORK_LOGITS, FRAMEWORK_ROWS, MachineRates
from .ops import DENSE, dtype_name
from .pipeline import pipelined
from .profile import SpeedProfile, load_profile
from .quantized import quantized_note, quantized_saving, quantized_times
from .setup import Setup  # (also read from here: tpkit.Setup, the tests)
from .trace_memo import remembered

DDP_BUCKET = 25 * 2 ** 20
ATTENTION_CORE = ("_scaled_dot_product", "softmax", "_softmax", "bmm", "baddbmm")


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One setup's predicted time per step (train, prefill) or per token (decode), its parts, and the memory
    one device holds."""

    setup: Setup
    goal: str
    seconds: float
    kernels_s: float
    overhead_s: float
    tp_communication_s: float
    dp_communication_s: float
    memory_bytes: float
    ops: int
    collectives: int
    process_bytes: float = 0.0  # what the rank's process holds at its peak: memory_bytes + imports + runtime
    compute_s: float = 0.0      # the part of kernels_s bound by arithmetic (the rest is bound by bytes)
    flops: float = 0.0          # the step's FLOPs on the device (recompute's again included)
    nbytes: float = 0.0         # bytes its kernels read and write
    collective_bytes: float = 0.0  # bytes of its tensor-parallel collectives' inputs
    activation_bytes: float = 0.0  # the part of memory_bytes that is activations kept for the backward (train)
    bubble_s: float = 0.0          # pipelining: the stages' idle time in the step
    pp_communication_s: float = 0.0  # pipelining: the activations and gradients sent between stages
    quantized: str = ""  # what the quantized layers were priced as (`quantized.quantized_note`); "" for a dense model
    cp_communication_s: float = 0.0  # context parallelism: attention's all-to-alls or ring sends, gradients over cp
    ep_communication_s: float = 0.0  # expert parallelism: MoE layers' all-to-alls, expert gradients over edp
    expert_bytes: float = 0.0        # the expert weights a rank holds under expert parallelism (0 at ep 1)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "setup": self.setup.to_dict()}


def kernel_seconds(trace: StepTrace, rates: MachineRates, phases: tuple[str, ...] | None = None,
                   names: tuple[str, ...] | None = None) -> float:
    """What the step's kernels take at `rates` (matmuls: FLOPs or streamed bytes, whichever is slower; other ops:
    their bytes; both plus the new pages of outputs the allocator does not keep), with no fixed cost; only ops of
    `phases` / whose name starts with one of `names` when given."""
    return sum(kernel_times(trace, rates, phases, names))


def kernel_times(trace: StepTrace, rates: MachineRates, phases: tuple[str, ...] | None = None,
                 names: tuple[str, ...] | None = None) -> tuple[float, float]:
    """`kernel_seconds` in two parts: (the ops bound by arithmetic, the ops bound by the bytes they move)."""
    compute = memory = 0.0
    for op in _ops(trace, phases, names):
        if op.view:
            continue
        own = op.quantized  # a quantized layer's product as its load runs it; a dense one's where calibrated
        if own is not None and (own.kind != DENSE or own.key in rates.quantized):
            arithmetic, streamed = quantized_times(op, rates)
            compute, memory = compute + arithmetic, memory + streamed
        elif op.mnk is not None or op.flops:
            m = op.mnk[0] if op.mnk is not None else 1024
            width = math.sqrt(op.mnk[1] * op.mnk[2]) if op.mnk is not None else None
            arithmetic = op.flops / rates.flops_rate(m, width, op.stored, op.dtype)
            streamed = op.nbytes / rates.weight_bandwidth(op.stored)
            if arithmetic > streamed:
                compute += arithmetic
            else:
                memory += streamed
        else:
            memory += op.nbytes / rates.copy_bandwidth
        memory += rates.fresh_seconds(op.fresh)
    return compute, memory


def skew_factor(rates: MachineRates, goal: str, tp: bool) -> float:
    """What converted kernels take over their isolated time: each collective waits for the slower rank (the skew
    measured on pieces streamed from memory for decoding, on pieces bound by arithmetic otherwise)."""
    return 1.0 + (rates.skew if goal == "decode" else rates.train_skew) if tp else 1.0


def _ops(trace: StepTrace, phases, names):
    return [o for o in trace.ops if (phases is None or o.phase in phases)
            and (names is None or o.name.startswith(names))]


@dataclasses.dataclass(frozen=True)
class _Priced:
    kernels: float
    overhead: float
    comm: float
    ops: int
    collectives: int
    compute: float = 0.0  # the part of `kernels` bound by arithmetic
    flops: float = 0.0
    nbytes: float = 0.0
    comm_bytes: float = 0.0
    ep_comm: float = 0.0  # the expert group's all-to-alls (not in `comm`)


def price(trace: StepTrace, rates: MachineRates, recompute: str = "none", layers: int | None = None,
          family: str | None = None, tp: bool | None = None, dp_mode: str | None = None,
          vocab: int | None = None, dtype: str = "float32") -> _Priced:
    """The step's kernels, fixed costs and tensor-parallel collectives at `rates` (recompute re-runs forward
    ops in the backward); the expert group's all-to-alls apart (`ep_comm`, with their in-step cost: the measured
    framework terms have none of them).

    Converted over ranks, the kernels take the measured skew longer (`skew_factor`).
    The fixed costs are the framework's own time composed per module where the machine measured it for the
    model's `family` (`framework.py`: a step's cost plus one per decoder layer of the `layers` traced, plus the
    optimizer's per parameter tensor; converted when `tp`, default: the trace spans ranks; under DDP / FSDP2
    when `dp_mode` and the machine measured that path; decoding, with what its batch rows and their `vocab`
    logits add; those measured in the model's `dtype` where the machine did), else the per-op cost of a reference
    model times the ops counted."""
    tp = trace.world_size > 1 if tp is None else tp
    per_op = rates.train_op_overhead_s if trace.goal == "train" else rates.op_overhead_s
    skew = skew_factor(rates, trace.goal, tp)
    compute, memory = kernel_times(trace, rates)
    n, again = len(trace.ops), []
    if trace.goal == "train" and recompute != "none":
        names = None if recompute == "full" else ATTENTION_CORE
        again = _ops(trace, ("forward",), names)
        compute, memory = (a + b for a, b in zip((compute, memory), kernel_times(trace, rates, ("forward",), names)))
    kernels, compute = (compute + memory) * skew, compute * skew
    in_step = rates.train_collective_overhead_s if trace.goal == "train" else rates.collective_overhead_s
    cost = rates.framework_cost(family, trace.goal, tp, dp_mode, dtype) if layers is not None else None
    if cost is not None:  # measured per module: the in-step cost of a collective is inside its layer's term
        rows, logits = ((trace.tokens, trace.tokens * vocab) if trace.goal == "decode" and vocab
                        else (FRAMEWORK_ROWS, FRAMEWORK_LOGITS))  # a training step's terms have no row terms
        overhead = cost.seconds(layers, rows, logits) + len(again) * per_op
        overhead += trace.parameter_tensors * rates.optimizer_tensor_s if trace.goal == "train" else 0.0
        in_step = 0.0
    else:
        overhead = (n + len(again)) * per_op
    experts = rates.train_collective_overhead_s if trace.goal == "train" else rates.collective_overhead_s
    comm, ep_comm = (sum(rates.collective(c.kind, c.world_size).seconds(c.nbytes) + wait for c in trace.collectives
                         if (c.group == "ep") == ep) for ep, wait in ((False, in_step), (True, experts)))
    work = [o for o in (*trace.ops, *again) if not o.view]
    return _Priced(kernels, overhead, comm, n + len(again), len(trace.collectives), compute,
                   sum(o.flops for o in work), sum(o.nbytes for o in work), sum(c.nbytes for c in trace.collectives),
                   ep_comm)


def plan_for(model: nn.Module, setup: Setup, goal: str, example=None):
    """The plan the converter makes for `model` (weightless) under `setup` (its families' choices)."""
    mode = "training" if goal == "train" else "inference"
    return propose(analyze_structure(model, example), setup.tp, mode, setup.choose())[0]


def _trace(model: nn.Module, setup: Setup, goal: str, batch: int, seq: int, example) -> StepTrace:
    """Rank 0's step; under context parallelism, a plain step of its share of the sequence (`context.py`); under
    expert parallelism, its experts dispatched over ep (`experts.py`)."""
    plan = plan_for(model, setup, goal, example) if setup.tp > 1 else "auto"
    return trace_step(model, goal, setup.tp, 0, batch, local_tokens(seq, setup.cp), plan=plan,
                      sequence_parallel=setup.sequence_parallel, example=example, meta_example=example, ep=setup.ep,
                      imbalance=setup.ep_imbalance)


def _extrapolate(values: list[tuple[int, float]], layers: int) -> float:
    if len(values) == 1:
        return values[0][1]
    (l0, a), (l1, b) = values
    return a + (layers - l0) * (b - a) / (l1 - l0)


@dataclasses.dataclass(frozen=True)
class Traced:
    """The traced steps of one conversion (one or two layer counts), reusable by setups that differ only in
    DP mode or recompute."""

    rows: tuple[tuple[int, StepTrace], ...]
    layers: int
    model: nn.Module


def trace_setup(model_or_config, setup: Setup, goal: str, batch_size: int, seq_len: int, example=None,
                dtype: torch.dtype | None = None, attention: str | None = None) -> Traced:
    """Trace rank 0's step under `setup` (its local batch: the batch shared out over dp)."""
    if goal not in GOALS:
        raise ValueError(f"predict: goal must be one of {GOALS}, got {goal!r}")
    check_priced(setup.cp, goal, model_or_config)
    local = -(-batch_size // setup.dp)

    def traced() -> Traced:
        models, layers = models_to_trace(model_or_config, dtype, attention)
        check_experts(setup.ep, expert_layers(models[-1][1]) if setup.ep > 1 else "", type(models[-1][1]).__name__)
        rows = tuple((n, _trace(model, setup, goal, local, seq_len, example)) for n, model in models)
        return Traced(rows, layers, models[0][1])
    source = trace_source(model_or_config, dtype, attention) if example is None else None
    key = None if source is None else (source, generation(), split_of(setup), goal, local, seq_len)
    return remembered(key, traced, errors=(PlanError,))


def split_of(setup: Setup) -> tuple:
    """What of `setup` its rank-0 step is traced under (`_trace`): setups alike in it share a trace."""
    return setup.tp, setup.sequence_parallel, setup.choices, setup.cp, setup.ep, setup.ep_imbalance


def predict(model_or_config, setup: Setup, goal: str = "train", batch_size: int = 1, seq_len: int = 128,
            profile: SpeedProfile | str | None = None, ranks: int | None = None, example=None,
            traced: Traced | None = None, dtype: torch.dtype | None = None, hardware=None,
            attention: str | None = None) -> Prediction:
    """Time and memory of `setup` for `goal` on this machine (see the module docstring). `profile`: a measured
    profile (`tpkit estimate --calibrate`); `ranks`: how many ranks share the machine (default: the setup's
    devices); `example`: a meta-device example input for a module without a config (its batch is the step's);
    `traced`: the step traced for an equivalent setup (`trace_setup`); `dtype`: the weights' (default: a config's
    bfloat16, a module's own); `hardware`: the `Hardware` whose datasheet prices the step when the profile was not
    measured op by op; `attention`: a config's attention kernel ("eager", else sdpa; default the config's)."""
    profile = profile if isinstance(profile, SpeedProfile) else load_profile(profile)
    if setup.pp > 1:
        return _pipelined(model_or_config, setup, goal, batch_size, seq_len, profile, ranks, example, traced, dtype,
                          hardware, attention)
    traced = traced or trace_setup(model_or_config, setup, goal, batch_size, seq_len, example, dtype, attention)
    item = next((p.element_size() for p in traced.model.parameters()), 2)
    rates = profile.rates(ranks or setup.devices, hardware, item)
    config = getattr(traced.model, "config", None)
    family = getattr(config, "model_type", None)  # the framework terms' key
    dp_mode = setup.dp_mode if setup.engine > 1 and goal == "train" else None
    weights = next((dtype_name(p.dtype) for p in traced.model.parameters() if p.is_floating_point()), "float32")
    rows = [(n, t, price(t, rates, setup.recompute, n if family else None, family, setup.tp > 1, dp_mode,
                         getattr(config, "vocab_size", None), weights))
            for n, t in traced.rows]
    layers = traced.layers

    def ex(f) -> float:
        return _extrapolate([(n, f(t, p)) for n, t, p in rows], layers)
    kernels, overhead = ex(lambda t, p: p.kernels), ex(lambda t, p: p.overhead)
    tp_comm, params = ex(lambda t, p: p.comm), ex(lambda t, p: t.parameter_bytes)
    experts = ex(lambda t, p: sum(math.prod(s) for s in t.expert_shapes) * item)  # kept apart from DDP / FSDP2
    dp_comm, compute = dp_seconds(setup, goal, params - experts, layers or 1, rates), ex(lambda t, p: p.compute)
    ep_comm = ex(lambda t, p: p.ep_comm + (expert_data_seconds(
        [math.prod(s) * item for s in t.expert_shapes], rates, setup.edp, rates.train_collective_overhead_s)
        if goal == "train" else 0.0))
    cp_parts = (0.0, 0.0, 0.0, 0.0)
    if setup.cp > 1:  # attention's kernels beyond the traced share, communication, messages, activations
        cp_parts = _context(setup, traced, rates, -(-batch_size // setup.dp), seq_len, item, attention)
        wait = skew_factor(rates, goal, setup.tp == 1)  # ranks meet at collectives: the TP skew, counted once
        kernels, compute = kernels * wait + cp_parts[0], compute * wait + cp_parts[0]
    elif setup.ep > 1 and setup.tp == 1:  # the expert group's ranks meet at every MoE layer: the skew, once
        wait = skew_factor(rates, goal, True)
        kernels, compute = kernels * wait, compute * wait
    parts = (params, ex(lambda t, p: t.saved_bytes), ex(lambda t, p: t.cache_bytes), traced.model, layers or 1,
             -(-batch_size // setup.dp), local_tokens(seq_len, setup.cp), experts)
    memory = _memory(setup, goal, *parts)
    peak = ex(lambda t, p: t.peak_bytes)
    if peak:  # the traced peak of the plain step, moved by what DP and recompute change (the sum of parts' delta)
        memory = peak + memory - _memory(Setup(setup.tp), goal, *parts)
    memory -= ex(lambda t, p: quantized_saving(t, setup, goal, item))
    memory += cp_parts[3]
    saved = min(ex(lambda t, p: t.saved_bytes) + cp_parts[3], memory) if goal == "train" else 0.0
    note = quantized_note({q.name: q for q in traced.rows[-1][1].quantized}, rates) or ""
    return Prediction(setup, goal, kernels + overhead + tp_comm + dp_comm + cp_parts[1] + ep_comm, kernels, overhead,
                      tp_comm, dp_comm, memory, int(round(ex(lambda t, p: p.ops))),
                      int(round(ex(lambda t, p: p.collectives) + cp_parts[2])),
                      memory + rates.import_bytes + rates.runtime_bytes, compute,
                      ex(lambda t, p: p.flops), ex(lambda t, p: p.nbytes), ex(lambda t, p: p.comm_bytes), saved,
                      quantized=note, cp_communication_s=cp_parts[1], ep_communication_s=ep_comm, expert_bytes=experts)


def _context(setup: Setup, traced: Traced, rates: MachineRates, batch: int, seq: int, item: int,
             attention: str | None) -> tuple[float, float, float, float]:
    """What context parallelism adds to the traced step of a rank's share of the tokens (`context.py`): (attention
    kernels: cp - 1 times the traced ones, recompute's again included, at the skew of ranks that wait for each other;
    the cp communication; its messages; activations beyond the traced ones, by formula)."""
    config = traced.model.config
    shape = dataclasses.replace(transformer_shape(config), num_layers=traced.layers or config.num_hidden_layers)
    method = attention_method(shape, setup.tp, setup.cp, setup.cp_method)
    traffic = layer_traffic(shape, batch, seq, item, setup.tp, setup.cp, method)
    skew, phases = skew_factor(rates, "train", True), [None] + ([("forward",)] if setup.recompute != "none" else [])

    def row(n: int, t: StepTrace) -> tuple[float, float, float]:
        core = sum(kernel_seconds(t, rates, p, ATTENTION_CORE) for p in phases)  # recompute: the forward's again
        grads = [math.prod(s) * item for s in t.parameter_shapes]
        return ((setup.cp - 1) * core * skew,
                context_seconds(traffic, n, grads, rates, setup.cp, rates.train_collective_overhead_s),
                context_messages(traffic, n, len(grads)))
    rows = [(n, row(n or shape.num_layers, t)) for n, t in traced.rows]  # n = 0: the model traced whole
    extra = context_extra_bytes(shape, batch, seq, item, setup.tp, setup.sequence_parallel, setup.recompute,
                                attention_kind(config, attention), setup.cp, setup.cp_method)
    return (*(_extrapolate([(n, r[i]) for n, r in rows], traced.layers) for i in range(3)), extra)


def _pipelined(model_or_config, setup: Setup, goal, batch_size, seq_len, profile, ranks, example, traced, dtype,
               hardware, attention) -> Prediction:
    """`setup` with pipeline stages: the same setup without them, priced at the same batch (memory, data
    parallelism) and at one micro-batch (the slots), then its bubble and stage sends (`pipeline.pipelined`); training
    only (torch's schedules run a training step)."""
    if goal != "train":
        raise ValueError(f"predict: pipeline parallelism (pp={setup.pp}) is priced for training steps, not {goal!r}")
    flat = dataclasses.replace(setup, pp=1, microbatches=1, stages_per_rank=1)
    base = predict(model_or_config, flat, goal, batch_size, seq_len, profile, ranks or setup.devices, example,
                   traced, dtype, hardware, attention)
    micro_batch = -(-batch_size // setup.microbatches)  # a slot runs one micro-batch: priced at its own size
    micro = None if micro_batch == batch_size or example is not None else predict(  # traced anew: at its batch
        model_or_config, flat, goal, micro_batch, seq_len, profile, ranks or setup.devices, None, None, dtype,
        hardware, attention)
    item = (dtype or own_dtype(model_or_config)).itemsize
    config = model_or_config if not isinstance(model_or_config, nn.Module) else getattr(model_or_config, "config",
                                                                                        None)
    hidden = getattr(config, "hidden_size", 0) or 0
    activation = -(-batch_size // setup.dp) * local_tokens(seq_len, setup.cp) * hidden * item  # at a stage boundary
    rates = profile.rates(ranks or setup.devices, hardware, item)
    return pipelined(base, setup, rates, activation, micro)


def dp_seconds(setup: Setup, goal: str, param_bytes: float, layers: int, rates: MachineRates) -> float:
    """Data parallelism's collectives per training step (none for inference: replicas work alone)."""
    n = setup.engine
    if n == 1 or goal != "train":
        return 0.0
    if setup.dp_mode == "ddp":
        buckets = max(1, math.ceil(param_bytes / DDP_BUCKET))
        return buckets * rates.collective("all_reduce", n).seconds(param_bytes / buckets)
    blocks = layers + 1  # every block, then the root
    shard = param_bytes / n / blocks
    gather = rates.collective("all_gather", n).seconds(shard)
    scatter = rates.collective("reduce_scatter", n).seconds(param_bytes / blocks)
    return blocks * (2 * gather + scatter)


def _memory(setup: Setup, goal: str, params: float, saved: float, cache: float, model: nn.Module, layers: int,
            batch: int, seq: int, experts: float = 0.0) -> float:
    """Bytes one device holds: weights; training adds gradients, AdamW's two fp32 states per parameter and
    the activations (recompute keeps a block's input instead); decode the KV cache. DDP / FSDP2 leave the
    `experts` bytes of expert-parallel weights alone (never sharded, not in a bucket)."""
    if goal != "train":
        return params + cache
    item = next((p.element_size() for p in model.parameters()), 4)
    states, dense = params + params + params / item * 8, params - experts
    if setup.dp_mode == "fsdp" and setup.engine > 1:  # a block's full parameters and gradients besides its shard
        states = states - (1 - 1 / setup.engine) * (dense + dense + dense / item * 8) + 2 * dense / max(layers, 1)
    elif setup.dp > 1:
        states += 2 * min(dense, DDP_BUCKET)
    if setup.recompute == "full":
        hidden = getattr(getattr(model, "config", None), "hidden_size", None) or 0
        tokens = batch * seq // (setup.tp if setup.sequence_parallel else 1)
        saved = min(saved, layers * tokens * hidden * item + saved / max(layers, 1))
    return states + saved
