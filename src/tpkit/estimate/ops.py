"""What one step of a converted model does on one rank, op by op, read off a fake run (no data, no peers).

The speed of small and latency-bound work is decided by what a roofline leaves out: every op's fixed cost
(dispatch, the framework's Python around it), matmuls at the shapes the model really uses, and each collective
as tpkit's own call path pays it. So a step is counted exactly as it will run: a weightless copy of the model
is converted for rank r of t by `parallelize` (the converter's plan: the same layers, head layout, sequence
parallel region and vocab-parallel loss), with a communicator that moves no data but writes down every
collective, and one step runs under `FakeTensorMode` with a dispatch recorder that writes down every aten op:
its FLOPs (matmuls and attention, from their shapes), the bytes it reads and writes, and whether it ran in the
forward, the backward or the optimizer step. Steps: "decode" (one token after a context of `seq` tokens in
the KV cache), "prefill" (one forward of `seq` tokens), "train" (forward with the loss, backward, an AdamW
step). Training also counts the bytes autograd saves (the activation memory).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..convert import parallelize, quiet_conversions
from .calls import as_call, meta_copy, to_empty_tied
from ..comm.shapes import ShapeCommunicator
from .peak import LiveBytes
from .traced import fake_tensors, saved_bytes

GOALS = ("decode", "prefill", "train")
# Ops that only rename, view or read metadata: no kernel runs and no bytes move (their cost is the dispatch).
VIEWS = frozenset("view _unsafe_view reshape expand t transpose permute unsqueeze squeeze slice select alias "
                  "as_strided detach lift_fresh _to_copy.no_copy split split_with_sizes unbind chunk narrow "
                  "unflatten flatten sym_size sym_stride sym_numel".split())
GATHERS = frozenset(("embedding", "index_select", "gather", "take"))


@dataclasses.dataclass(frozen=True)
class Op:
    """One aten op of the step: FLOPs (0 for non-matmul ops), bytes read and written, the matmul's (m, n, k)
    when it is one, and the phase it ran in."""

    name: str
    phase: str
    flops: float
    nbytes: float
    mnk: tuple[int, int, int] | None = None
    view: bool = False
    stored: bool = False  # a matmul reading its second operand as stored, rows of k (GPT-2's Conv1D), not transposed


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective the plan adds: its kind, the bytes of this rank's input, the world size it spans."""

    kind: str
    nbytes: int
    world_size: int
    phase: str


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


class RecordingCommunicator(ShapeCommunicator):
    """A shape-only communicator that writes down every collective (kind, input bytes, phase)."""

    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size)
        self.calls: list[Collective] = []

    def _note(self, kind: str, tensor: torch.Tensor) -> None:
        self.calls.append(Collective(kind, tensor.numel() * tensor.element_size(), self.world_size, _phase()))

    def _all_reduce(self, tensor, op, async_op):
        self._note("all_reduce", tensor)
        return super()._all_reduce(tensor, op, async_op)

    def _all_reduce_(self, tensor, op):
        self._note("all_reduce", tensor)
        return super()._all_reduce_(tensor, op)

    def _all_gather(self, tensor, dim, sizes, async_op):
        self._note("all_gather", tensor)
        return super()._all_gather(tensor, dim, sizes, async_op)

    def _reduce_scatter(self, tensor, op, dim, sizes, async_op):
        self._note("reduce_scatter", tensor)
        return super()._reduce_scatter(tensor, op, dim, sizes, async_op)


def _phase() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def _matmul(name: str, args: tuple, out: Any) -> tuple[float, tuple[int, int, int] | None, bool]:
    """(FLOPs, (m, n, k), whether the second operand is read as stored) of a matmul-like op from its shapes;
    (0, None, False) for anything else. `linear` reads its weight transposed (nn.Linear's [n, k]); `mm` and
    `addmm` read theirs as stored when it is contiguous [k, n] (a Conv1D), transposed when it is a view of one."""
    if name in ("mm", "addmm", "linear", "bmm", "baddbmm", "matmul"):
        a = args[1] if name in ("addmm", "baddbmm") else args[0]
        b = args[2] if name in ("addmm", "baddbmm") else args[1] if len(args) > 1 else None
        if not isinstance(out, torch.Tensor) or not isinstance(a, torch.Tensor) or a.dim() == 0:
            return 0.0, None, False
        k = a.shape[-1]
        n = out.shape[-1]
        m = out.numel() // max(n, 1)
        stored = name != "linear" and isinstance(b, torch.Tensor) and b.dim() >= 2 and b.stride(-1) == 1 and n > 1
        return 2.0 * m * n * k, (int(m), int(n), int(k)), bool(stored)
    if "scaled_dot_product" in name and isinstance(args[0], torch.Tensor):
        q, key = args[0], args[1]
        flops = 4.0 * math.prod(q.shape[:-1]) * key.shape[-2] * q.shape[-1]
        return (2.5 * flops if "backward" in name else flops), None, False
    return 0.0, None, False


class OpRecorder(TorchDispatchMode):
    """Writes down every aten op that runs (see `Op`)."""

    def __init__(self, phase: str | None = None):
        super().__init__()
        self.phase = phase
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        flops, mnk, stored = _matmul(name, args, out)
        view = name in VIEWS or func.namespace == "prim"  # prim ops read metadata (a tensor's device)
        if view:
            nbytes = 0
        elif name in GATHERS:  # reads the rows it returns, not the whole table
            nbytes = 2 * _nbytes(out)
        else:
            nbytes = _nbytes(list(args) + list((kwargs or {}).values())) + _nbytes(out)
        self.ops.append(Op(name, self.phase or _phase(), flops, float(nbytes), mnk, view, stored))
        return out


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
                     sequence_parallel: bool = False, example_inputs: Any = None) -> tuple[nn.Module, RecordingCommunicator]:
    """A weightless copy of `model` converted for `rank` of `world_size` with `plan`, and the communicator that
    records its collectives."""
    comm = RecordingCommunicator(rank, world_size)
    copy_ = meta_copy(model)
    if world_size > 1:
        with quiet_conversions():  # an estimate's own conversion: what stays whole is in its report
            parallelize(copy_, plan, comm=comm, mode=mode, sequence_parallel=sequence_parallel,
                        example_inputs=example_inputs)
    return copy_, comm


def trace_step(model: nn.Module, goal: str, world_size: int = 1, rank: int = 0, batch: int = 1, seq: int = 128,
               plan: Any = "auto", sequence_parallel: bool = False, example=None,
               meta_example: Any = None) -> StepTrace:
    """One `goal` step of `model` as rank `rank` of `world_size` runs it (see the module docstring). `model` may
    be on the meta device; it is not changed. `meta_example`: the example on the meta device, for the plan's
    trace of a module without a config."""

    if goal not in GOALS:
        raise ValueError(f"trace_step: goal must be one of {GOALS}, got {goal!r}")
    training = goal == "train"
    work, comm = convert_for_rank(model, rank, world_size, plan, "training" if training else "inference",
                                  sequence_parallel and training, meta_example)
    params = {id(p): p.numel() * p.element_size() for p in work.parameters()}
    work.train(training)
    with fake_tensors(work):
        work = to_empty_tied(work)
        recorder, saved, cache = OpRecorder(), 0, 0
        live = LiveBytes([*work.parameters(), *work.buffers()])
        if goal == "decode":
            with live:
                cache = _decode(work, batch, seq, recorder, comm)
        elif goal == "prefill":
            args, kwargs = fake_inputs(work, batch, seq, example)
            with torch.no_grad(), recorder, live:
                work(*args, **kwargs)
        else:
            saved = _train(work, batch, seq, example, recorder, live)
    tokens = batch if goal == "decode" else batch * seq
    tensors = sum(1 for p in {id(p): p for p in work.parameters()}.values() if p.requires_grad)
    return StepTrace(goal, world_size, rank, tuple(recorder.ops), tuple(comm.calls), sum(params.values()), saved,
                     cache, tokens, tensors, live.peak)


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
    return sum(_nbytes(t) for t in tensors if isinstance(t, torch.Tensor))


def _train(work: nn.Module, batch: int, seq: int, example, recorder: OpRecorder, live: LiveBytes) -> int:
    """Forward with the loss (saved bytes counted), backward, one AdamW step; returns the saved bytes. Then a
    second step, the steady one (its optimizer states exist from the start), runs under `live` alone, its
    optimizer ops recorded (the first step's include making the states, which a later step does not): its peak is
    the memory the step needs (the first one's is not: a real first step held 4.4 MB less than every later one
    on a 2.2 MB model). Two passes, because counting saved bytes keeps every saved tensor alive to the forward's
    end, which would move the peak."""
    args, kwargs = fake_inputs(work, batch, seq, example, labels=True)
    outputs: list = []
    with recorder:
        saved = saved_bytes(work, args, kwargs, outputs)
        loss_of(outputs[0]).backward()
    outputs.clear()
    optimizer = torch.optim.AdamW([p for p in work.parameters() if p.requires_grad], lr=1e-3)
    optimizer.step()  # makes the states (zeros_like per tensor): a first step's work, not a step's
    optimizer.zero_grad(set_to_none=True)
    live.hold(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    step = OpRecorder("optimizer")
    with live:
        loss_of(work(*args, **kwargs)).backward()
        with step:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    recorder.ops.extend(step.ops)
    return saved


def summary_counts(trace: StepTrace) -> Mapping[str, float]:
    """Totals for reports: ops (kernels and views), FLOPs, bytes, collectives and their bytes."""
    kernels = [o for o in trace.ops if not o.view]
    return {"ops": len(trace.ops), "kernels": len(kernels), "flops": sum(o.flops for o in kernels),
            "bytes": sum(o.nbytes for o in kernels), "collectives": len(trace.collectives),
            "collective_bytes": sum(c.nbytes for c in trace.collectives)}
