"""What the fake step writes down, op by op: every aten op that runs (`OpRecorder`: its FLOPs from the matmul and
attention shapes, the bytes it reads and writes, whether it is a view, whether a matmul reads its weight as stored,
the phase it ran in: forward, backward or the optimizer step, and, for a matmul of a linear layer a quantized
checkpoint stores packed, that layer's `quantized.QuantizedLayer`: its product is priced as the load runs it) and
every collective the converted model calls (`RecordingCommunicator`: a shape-only communicator that notes each
call's kind, input bytes and phase).

Why op by op: the speed of small and latency-bound work is decided by what a roofline leaves out: every op's fixed
cost, matmuls at the shapes the model really uses, each collective as tpkit's own call path pays it. The step these
recorders follow is run by `fake_step.trace_step`; `predict.price` prices what they wrote.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Iterator, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..comm.shapes import ShapeCommunicator
from ..quant.products import dense_applies

# Ops that only rename, view or read metadata: no kernel runs and no bytes move (their cost is the dispatch).
VIEWS = frozenset("view _unsafe_view reshape expand t transpose permute unsqueeze squeeze slice select alias "
                  "as_strided detach lift_fresh _to_copy.no_copy split split_with_sizes unbind chunk narrow "
                  "unflatten flatten sym_size sym_stride sym_numel".split())
GATHERS = frozenset(("embedding", "index_select", "gather", "take"))
_LINEAR = frozenset(("mm", "addmm", "linear", "matmul"))  # a linear layer's product (not attention's bmm)
DENSE = "dense"  # the kind of a dense layer recorded as its own decode product (`quantized.dense_layers`)
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): torch's CPU allocator asks glibc for every
# tensor, and a block at least this large is always its own mapping, unmapped when freed, so each one a step makes
# comes back as new pages the kernel must fault in and zero (a Llama h1792 x 2 layers faulted 78k pages in its
# backward, its gradients this large, and twice that in AdamW, every step). `Op.fresh` counts such outputs.
FRESH_BLOCK_BYTES = 32 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: how profiles and traced ops name a dtype."""
    return str(dtype).removeprefix("torch.")


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
    quantized: Any = None  # the product of a layer stored quantized (`quantized.QuantizedLayer`): priced as it runs
    # (or of a dense bf16 / fp16 / float32 layer at decode's rows: tpkit's product, `quantized.dense_layers`)
    dtype: str = ""  # the dtype of an op with FLOPs ("bfloat16", ...): BLAS has a rate per dtype (`dtype_gemm`)
    fresh: float = 0.0  # bytes of the new tensors it returns of at least FRESH_BLOCK_BYTES each (new pages)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective the plan adds: its kind, the bytes of this rank's input, the world size it spans, and the
    group it runs in ("tp"; "ep": the expert group's all-to-alls, `experts.py`)."""

    kind: str
    nbytes: int
    world_size: int
    phase: str
    group: str = "tp"


class RecordingCommunicator(ShapeCommunicator):
    """A shape-only communicator that writes down every collective (kind, input bytes, phase) in `calls` (a list
    it may share with another group's), as collectives of `group`."""

    def __init__(self, rank: int, world_size: int, calls: list[Collective] | None = None, group: str = "tp"):
        super().__init__(rank, world_size)
        self.calls: list[Collective] = calls if calls is not None else []
        self.group = group

    def _note(self, kind: str, tensor: torch.Tensor) -> None:
        self.calls.append(Collective(kind, tensor.numel() * tensor.element_size(), self.world_size, _phase(),
                                     self.group))

    def _all_reduce(self, tensor, op, async_op):
        self._note("all_reduce", tensor)
        return super()._all_reduce(tensor, op, async_op)

    def _all_reduce_(self, tensor, op):
        self._note("all_reduce", tensor)
        return super()._all_reduce_(tensor, op)

    def _all_gather(self, tensor, dim, sizes, async_op):
        self._note("all_gather", tensor)
        return super()._all_gather(tensor, dim, sizes, async_op)

    def _all_to_all(self, tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes, async_op):
        self._note("all_to_all", tensor)
        return super()._all_to_all(tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes, async_op)

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


def _fresh_bytes(func, out: Any) -> int:
    """Bytes of the tensors `func` returns newly made (its schema names no alias: not a view, not written in place,
    not an `out=`) that are each at least FRESH_BLOCK_BYTES."""
    returns = func._schema.returns
    if any(r.alias_info is not None for r in returns):
        return 0
    tensors = [t for v in (out if isinstance(out, (tuple, list)) else (out,))
               for t in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(t, torch.Tensor)]
    sizes = (t.numel() * t.element_size() for t in tensors)
    return sum(n for n in sizes if n >= FRESH_BLOCK_BYTES)


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
        self.layer = None  # the quantized layer whose forward is running (`quantized_layers`)

    @contextlib.contextmanager
    def quantized_layers(self, model: torch.nn.Module, layers: Mapping[str, Any]) -> Iterator[None]:
        """While on, the matmul of each module of `model` named in `layers` (name -> `quantized.QuantizedLayer`)
        is recorded as that layer's quantized product: its bytes the stored tensors' in place of the dense
        weight's (forward hooks on the modules, removed on the way out)."""
        def enter(layer):
            return lambda module, args: setattr(self, "layer", layer)
        handles = []
        for name, layer in layers.items():
            module = model.get_submodule(name)
            handles += [module.register_forward_pre_hook(enter(layer)),
                        module.register_forward_hook(lambda module, args, out: setattr(self, "layer", None))]
        try:
            yield
        finally:
            self.layer = None
            for h in handles:
                h.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        flops, mnk, stored = _matmul(name, args, out)
        layer = self.layer if mnk is not None and name in _LINEAR else None
        x, w = (args[1], args[2]) if name == "addmm" else (args[0], args[1] if len(args) > 1 else None)
        grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (x, w))
        if layer is not None and layer.kind == DENSE and not dense_applies(w.dtype, mnk[0], grad):
            layer = None  # a dense layer's own product runs where `dense_linear` runs it, and only there
        elif layer is not None and grad:
            layer = dataclasses.replace(layer, path="dequantize")  # the kernels have no backward
        view = name in VIEWS or func.namespace == "prim"  # prim ops read metadata (a tensor's device)
        if view:
            nbytes = 0
        elif name in GATHERS:  # reads the rows it returns, not the whole table
            nbytes = 2 * _nbytes(out)
        else:
            nbytes = _nbytes(list(args) + list((kwargs or {}).values())) + _nbytes(out)
        if layer is not None:  # the stored tensors are read in place of the dense weight
            nbytes += layer.stored_bytes - layer.dense_bytes
        first = out[0] if isinstance(out, (tuple, list)) and out else out  # attention's kernels return tuples
        dtype = dtype_name(first.dtype) if flops and isinstance(first, torch.Tensor) else ""
        fresh = 0 if view else _fresh_bytes(func, out)
        self.ops.append(Op(name, self.phase or _phase(), flops, float(nbytes), mnk, view, stored, layer, dtype,
                           float(fresh)))
        return out
