"""The one fake run of the estimates: one step of a weightless copy of a model, converted for one rank, on fake
tensors. Every figure read off a model's step comes from here: the speed estimate's op trace (`predict.py`), the
memory estimate's activations and parameter shapes (`traced.py`), and a plain module's measured step (`measure.py`,
through `fake_tensors`). It is the only place the estimates make fake tensors.

How: a weightless (meta) copy of the model is converted for rank r of t by `parallelize` (the converter's plan: the
same layers, head layout, sequence parallel region and vocab-parallel loss a real rank gets), with a communicator
that moves no data but writes down every collective (`ops.RecordingCommunicator`), and one step runs under
`FakeTensorMode` (shapes and dtypes, no data: a 70B layer costs what a 70-parameter one does) with the op recorder
(`ops.OpRecorder`) and the live-bytes counter (`peak.LiveBytes`) on. Steps: "decode" (one token after a context of
`seq` tokens in the KV cache), "prefill" (one forward of `seq` tokens), "train" (forward with the loss, backward, an
AdamW step; `backward=False` stops after the forward, all the memory estimate needs). Training counts the bytes
autograd saves for backward (`saved_bytes`: distinct storages, parameters and buffers excluded, exactly as the
tests measure a real forward). The linear layers a quantized checkpoint stores packed (its config's
`quantization_config`) are found on the converted copy (`quantized.quantized_layers`) and their matmuls recorded as
the products a rank's load runs; so are the dense bf16 / fp16 / float32 parallel layers' at decode's rows
(`dense_layers`: tpkit's own product there, not BLAS).

Transformers' experts run through batched_mm here, as in the planner's trace (`traceable_experts`): their eager
loop asks which experts got tokens (`nonzero`), which fake tensors cannot answer. Under expert parallelism (`ep` > 1)
they are the runtime's dispatched experts of ep rank `rank`, exchanging what uniform routing sends (`experts.py`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Iterator

import torch
from torch import nn

from ..convert import parallelize, quiet_conversions
from ..convert.trace.structure import traceable_experts
from ..nn.decode import adopt_decode_paths
from .calls import as_call, meta_copy, to_empty_tied
from .experts import DEFAULT_IMBALANCE, expert_shapes, spread_experts
from .ops import Collective, Op, OpRecorder, RecordingCommunicator
from .peak import LiveBytes
from .quantized import dense_layers, quantized_layers

GOALS = ("decode", "prefill", "train")


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """Everything one step of rank `rank` of `world_size` does (see the module docstring)."""

    goal: str
    world_size: int
    rank: int
    ops: tuple[Op, ...]
    collectives: tuple[Collective, ...]
    parameter_bytes: int     # this rank's parameters
    saved_bytes: int         # what the training forward keeps for backward (0 for inference)
    cache_bytes: int         # the KV cache after the step (decode)
    tokens: int              # tokens the step processes (decode: the batch)
    parameter_tensors: int = 0  # this rank's parameter tensors the optimizer steps (training)
    peak_bytes: int = 0         # the most tensor bytes held at once in a steady step (`peak.LiveBytes`)
    parameter_shapes: tuple[tuple[int, ...], ...] = ()  # this rank's parameters, each once (tied ones too)
    quantized: tuple = ()  # the linear layers a quantized checkpoint stores packed (`quantized.QuantizedLayer`)
    expert_shapes: tuple[tuple[int, ...], ...] = ()  # expert weights spread over ep (kept apart from DDP / FSDP2)


@contextlib.contextmanager
def fake_tensors(model: nn.Module) -> Iterator[None]:
    """Fake tensors for a meta `model`'s estimate run (the one `FakeTensorMode` of the estimates), with
    transformers' experts through batched_mm as in the planner's trace."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with traceable_experts(model.modules()), FakeTensorMode(allow_non_fake_inputs=True):
        yield


def saved_bytes(model: nn.Module, args=(), kwargs=None, outputs: list | None = None) -> int:
    """Bytes `model(*args, **kwargs)` saves for backward: distinct storages, parameters and buffers excluded
    (the forward's output is appended to `outputs` when given, for a backward after).

    The measurement itself (the tests run it on real tensors, the estimate on fake ones)."""
    skip = {p.untyped_storage()._cdata for p in model.parameters()}
    skip |= {b.untyped_storage()._cdata for b in model.buffers()}
    seen: dict[int, int] = {}
    alive = []  # keep every saved storage alive, so no storage address is reused while counting (the storages,
    # not the tensors: a tensor's lifetime is what `peak.LiveBytes` follows in the same pass)

    def pack(x):
        storage = x.untyped_storage()
        alive.append(storage)
        if storage._cdata not in skip:
            seen[storage._cdata] = storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = model(*args, **(kwargs or {}))
    if outputs is not None:
        outputs.append(out)
    return sum(seen.values())


def fake_inputs(model: nn.Module, batch: int, seq: int, example=None, labels: bool = False) -> tuple[tuple, dict]:
    """The forward's arguments (call inside the fake mode): the example's shapes and dtypes, else token ids
    (with labels when asked and the forward takes them)."""
    if example is not None:
        args, kwargs = as_call(example)

        def fake(v):
            return torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v
        return tuple(fake(a) for a in args), {k: fake(v) for k, v in kwargs.items()}
    ids = torch.zeros(batch, seq, dtype=torch.long)
    kwargs = {"input_ids": ids}
    if labels and "labels" in inspect.signature(model.forward).parameters:
        kwargs["labels"] = ids
    return (), kwargs


def loss_of(out: Any) -> torch.Tensor:
    """The loss a training step differentiates: the output's `.loss`, else the sum of its first tensor."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = out if isinstance(out, torch.Tensor) else (out[0] if isinstance(out, (tuple, list)) else out.logits)
    return first.float().sum()


def convert_for_rank(model: nn.Module, rank: int, world_size: int, plan: Any = "auto", mode: str = "inference",
                     sequence_parallel: bool = False, example_inputs: Any = None, ep: int = 1,
                     imbalance: float = DEFAULT_IMBALANCE) -> tuple[nn.Module, RecordingCommunicator]:
    """A weightless copy of `model` converted for `rank` of `world_size` with `plan` (its experts then spread over
    `ep` ranks as ep rank `rank`: `experts.spread_experts`), and the communicator that records its collectives
    (the expert group's too)."""
    from ..quant import config_quantization

    comm = RecordingCommunicator(rank, world_size)
    copy_ = meta_copy(model)
    config = getattr(model, "config", None)
    if world_size > 1:  # a quantized checkpoint's pairs split in whole groups, as its load splits them
        with quiet_conversions():  # an estimate's own conversion: what stays whole is in its report
            parallelize(copy_, plan, comm=comm, mode=mode, sequence_parallel=sequence_parallel,
                        example_inputs=example_inputs,
                        quantization=config_quantization(config) if config is not None else None)
    else:  # nothing split: every Linear whole, multiplying at decode as the conversion makes it (`DecodeLinear`)
        adopt_decode_paths(copy_)
    if ep > 1:
        spread_experts(copy_, RecordingCommunicator(rank, ep, comm.calls, "ep"), comm, imbalance)
    return copy_, comm


def trace_step(model: nn.Module, goal: str, world_size: int = 1, rank: int = 0, batch: int = 1, seq: int = 128,
               plan: Any = "auto", sequence_parallel: bool = False, example=None,
               meta_example: Any = None, backward: bool = True, ep: int = 1,
               imbalance: float = DEFAULT_IMBALANCE) -> StepTrace:
    """One `goal` step of `model` as rank `rank` of `world_size` runs it (see the module docstring). `model` may
    be on the meta device; it is not changed. `example`: the forward's input (its shapes and dtypes), else token
    ids of `batch` x `seq`; `meta_example`: the example on the meta device, for the plan's trace of a module without
    a config; `backward=False`: a training step's forward only (its saved bytes; no op recorded); `ep` > 1: its
    experts spread over ep ranks (`plan` keeping them whole), routing uniform up to `imbalance`."""
    if goal not in GOALS:
        raise ValueError(f"trace_step: goal must be one of {GOALS}, got {goal!r}")
    training = goal == "train"
    work, comm = convert_for_rank(model, rank, world_size, plan, "training" if training else "inference",
                                  sequence_parallel and training, meta_example, ep, imbalance)
    unique = list({id(p): p for p in work.parameters()}.values())
    params, shapes = sum(p.numel() * p.element_size() for p in unique), tuple(tuple(p.shape) for p in unique)
    quantized = quantized_layers(model, work)
    work.train(training)
    with fake_tensors(work):
        work = to_empty_tied(work)
        recorder, saved, cache = OpRecorder(), 0, 0
        live = LiveBytes([*work.parameters(), *work.buffers()])
        with recorder.quantized_layers(work, {**dense_layers(work), **quantized}):
            saved, cache = _run_step(work, goal, batch, seq, example, recorder, live, backward, comm)
    tokens = batch if goal == "decode" else batch * seq
    tensors = sum(1 for p in unique if p.requires_grad)
    return StepTrace(goal, world_size, rank, tuple(recorder.ops), tuple(comm.calls), params, saved, cache, tokens,
                     tensors, live.peak, shapes, tuple(quantized.values()), expert_shapes(work))


def _run_step(work: nn.Module, goal: str, batch: int, seq: int, example, recorder: OpRecorder, live: LiveBytes,
              backward: bool, comm: RecordingCommunicator) -> tuple[int, int]:
    """The step itself, inside the fake mode: (bytes saved for backward, the KV cache's bytes)."""
    if goal == "decode":
        with live:
            return 0, _decode(work, batch, seq, recorder, comm)
    if goal == "prefill":
        args, kwargs = fake_inputs(work, batch, seq, example)
        with torch.no_grad(), recorder, live:
            work(*args, **kwargs)
        return 0, 0
    return _train(work, batch, seq, example, recorder, live, backward), 0


def _decode(work: nn.Module, batch: int, seq: int, recorder: OpRecorder, comm: RecordingCommunicator) -> int:
    """One decoded token after a prefill of `seq` tokens (only the token's ops and collectives are kept);
    returns the KV cache's bytes."""
    ids = torch.zeros(batch, seq, dtype=torch.long)
    with torch.no_grad():
        out = work(input_ids=ids, use_cache=True)
        comm.calls.clear()
        with recorder:
            out = work(input_ids=ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
    cache = out.past_key_values
    tensors = [t for layer in getattr(cache, "layers", []) for t in (getattr(layer, "keys", None),
                                                                     getattr(layer, "values", None))]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _train(work: nn.Module, batch: int, seq: int, example, recorder: OpRecorder, live: LiveBytes,
           backward: bool = True) -> int:
    """The steady training step: forward with the loss (saved bytes counted), backward, one AdamW step, all recorded
    and followed by `live`; returns the saved bytes (`backward` False: the forward alone, unrecorded).

    The optimizer states exist from the step's start, as in every step after a real first one: an unrecorded
    AdamW step on zero gradients makes them first (the first step's `zeros_like` per tensor is not a step's work,
    and a real first step held 4.4 MB less than every later one on a 2.2 MB model). One pass counts both the saved
    bytes and the peak: `saved_bytes` keeps the saved tensors' storages alive, not the tensors `live` follows, and
    the communicator records each collective of the step once."""
    args, kwargs = fake_inputs(work, batch, seq, example, labels=True)
    if not backward:  # the memory estimate's forward: its saved bytes alone, no op recorded
        return saved_bytes(work, args, kwargs)
    trained = [p for p in work.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3)  # as a CPU step runs it: one tensor at a time
    for p in trained:
        p.grad = torch.zeros_like(p)
    maker = torch.optim.AdamW(trained, lr=1e-3, foreach=True)  # the same states, in a tenth of the ops
    maker.step()
    optimizer.state = maker.state
    optimizer.zero_grad(set_to_none=True)
    live.hold(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    outputs: list = []
    with recorder, live:
        saved = saved_bytes(work, args, kwargs, outputs)
        loss_of(outputs.pop()).backward()  # the output let go before the backward, as `model(x).loss.backward()` does
        recorder.phase, phase = "optimizer", recorder.phase
        try:
            optimizer.step()
        finally:
            recorder.phase = phase
    optimizer.zero_grad(set_to_none=True)
    return saved
