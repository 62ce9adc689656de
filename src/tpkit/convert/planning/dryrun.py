"""The dry run between planning and the swap: the converted model's forward, once, on the meta device.

A model's own forward may assume what a split breaks, a packed projection reshaped with a hard-coded group count
(`qkv.view(b, s, 4, -1, d)` with a quarter of the features on each rank) being the common case. The trace cannot
see that; running the converted structure can. `dry_run` deep-copies the model onto the meta device (no values, no
memory; a small model whose forward needs values, a real copy), applies the plan there with a `ShapeCommunicator`
(collectives return the shapes this rank would get), and runs the example inputs through it. A tiny model
(`REAL_FIRST_BYTES`) is run on a real copy first (weights on the meta device become zeros there): torch's meta
kernels are Python, so its forward on meta tensors costs ~15 times a real one. Only a clean pass there is taken;
anything else (a failure, a layer that cannot be built, head sizes it cannot compare) is decided by the meta-device
run as before. When the forward fails, the module that owns the failing op (the innermost running module holding
split layers), and every module of the same class at the same place in the other repeated blocks, is kept whole
with the error as the reason, and the run is repeated. A forward that runs but cuts a split attention block into
heads of another size than the whole model does (a head size computed from a width the split made local) is a
failure too (`head_reshapes.py`). A plan the user wrote is not changed: its failure is a PlanError. Nothing here
touches the model.
"""
from __future__ import annotations

import dataclasses
import re
import sys
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from ...comm.shapes import ShapeCommunicator
from ..errors import PlanError
from .head_reshapes import HeadReshapes, changed, from_trace, watched
from ..plan import Plan
from ..layouts import plan_layouts
from ..steps import prepare
from ..swap import swap
from ..styles import REPLICATE
from ..trace import Analysis, traceable_experts
from ..trace.structure import copy_on

MAX_ROUNDS = 8
REAL_COPY_BYTES = 1 << 30  # a model whose forward needs values (`.item()`) is dry-run on a real copy up to this
REAL_FIRST_BYTES = 16 << 20  # a model up to this is dry-run on a real copy first (faster than on meta tensors)
Failure = tuple  # (names of the running modules, outermost first; "Type: message")
KEPT = "kept whole: the converted forward"  # how every reason the dry run gives begins


def dry_run(model: nn.Module, the_plan: Plan, analysis: Analysis, comm, sequence_parallel: bool = False,
            fixed: Callable[[str], bool] = lambda name: False) -> Plan:
    """`the_plan` (resolved against `model`: its entries are module names and canonical styles, `steps.resolved`),
    with what fails in the converted forward kept whole (see the module's doc). Each round changes a copy of the
    resolved styles; the plan is rebuilt from them once, at the end. `fixed(name)`: whether the user's plan named
    that module (a failure there raises PlanError instead). `analysis.copy_bytes` decides whether a real copy is
    cheap enough (`REAL_COPY_BYTES`) and whether to try one first (`REAL_FIRST_BYTES`): on a model cut to its
    distinct blocks it is the whole model's, so the cut is dry-run as the whole model would be."""
    inputs = getattr(analysis.trace, "inputs", None) if analysis.trace is not None else None
    styles, details = dict(the_plan.entries), the_plan.details
    if inputs is None or comm.world_size == 1 or not _splits(styles):
        return the_plan
    copyable = analysis.copy_bytes <= REAL_COPY_BYTES
    whole = _Whole(model, analysis, inputs)
    if analysis.copy_bytes <= REAL_FIRST_BYTES:
        try:
            if _try(model, styles, details, analysis, comm.world_size, sequence_parallel, inputs, False, whole,
                    clean=True) is None:
                return the_plan  # every rank's converted forward ran on real tensors, with the whole model's heads
        except Exception:  # noqa: BLE001 - not a clean pass (a copy or a layer not made, a PlanError): as below
            pass
    on_meta: bool | None = None  # whether its own forward runs on meta tensors: asked once a converted one fails
    reasons: dict[str, str] = {}
    rounds = 0
    while rounds < MAX_ROUNDS:
        rounds += 1
        try:
            failure = _try(model, styles, details, analysis, comm.world_size, sequence_parallel, inputs,
                           on_meta is not False, whole)
        except _NoCopy:  # a model that cannot be copied is converted without a dry run
            return the_plan
        except PlanError:
            if styles == the_plan.entries:
                raise
            failure = ("",), "PlanError: what is left split after keeping blocks whole does not validate"
        if failure is not None and on_meta is None:
            on_meta = whole.runs(True)
            if not on_meta:
                if not copyable:
                    return the_plan  # its forward does not run on meta tensors, and a real copy would cost too much
                rounds -= 1
                continue  # the same plan again, on a real copy
        if failure is None:
            return _kept(the_plan, styles, reasons)
        running, error = failure
        blocks = _blocks(model, _owner(running, styles))
        named = [n for n in _names_under(blocks, styles) if fixed(n)]
        if named:
            raise PlanError(f"the converted forward fails in {blocks[0] or 'the model'!r} on a dry run before any "
                            f"change ({error}); the plan splits {named[:3]} there: keep them 'replicate'")
        keep_whole(styles, reasons, blocks, f"{KEPT} fails here ({error})", analysis)
        if "" in blocks:
            return _kept(the_plan, styles, reasons)
    keep_whole(styles, reasons, [""], f"{KEPT} kept failing on a dry run", analysis)
    return _kept(the_plan, styles, reasons)


def _kept(the_plan: Plan, styles: dict[str, str], reasons: dict[str, str]) -> Plan:
    """The plan once, from the dry run's styles and the reasons it added."""
    if not reasons and styles == the_plan.entries:
        return the_plan
    return the_plan.replaced(styles, reasons={**the_plan.reasons, **reasons})


class _NoCopy(Exception):
    """The model cannot be deep-copied onto the meta device (then there is no dry run)."""


class _Unclear(Exception):
    """A real-copy run first (`clean=True`) that cannot tell: the meta-device run decides."""


class _Whole:
    """The unconverted model's forward on a copy, run only when asked and once per kind of copy (meta or real):
    whether it runs, and the sizes its attention blocks cut their features into heads (`head_reshapes.py`).
    Asked whether it runs on meta only after a converted forward failed there (a converted forward that runs
    there needs no answer), and for the head sizes only when a converted one cut a split block into heads; those
    the trace recorded are read from it instead (see `heads`)."""

    def __init__(self, model: nn.Module, analysis: Analysis, inputs: Any):
        self.model, self.analysis, self.inputs = model, analysis, inputs
        self.attention = watched(analysis.pairs, {p.row for p in analysis.pairs})
        self._done: dict[bool, tuple[bool, dict[str, list[int]]]] = {}

    def runs(self, on_meta: bool) -> bool:
        return self._run(on_meta)[0]

    def heads(self, on_meta: bool) -> dict[str, list[int]] | None:
        """The head sizes of the whole model's forward. The trace ran that forward on the same inputs and recorded
        them (`Trace.head_cuts`): read there when every watched module ran in it (a tower traced on its own did
        not), for either kind of copy (sizes computed from shapes and the config are the same on meta and real
        tensors, whichever the trace ran on). Otherwise the forward runs on a copy of that kind: None when it
        does not run there."""
        trace = self.analysis.trace
        if trace is not None and trace.head_cuts and all(n in trace.module_inputs for n in self.attention):
            return from_trace(trace.head_cuts, self.attention)
        ran, seen = self._run(on_meta)
        return seen if ran else None

    def _run(self, on_meta: bool) -> tuple[bool, dict[str, list[int]]]:
        if on_meta not in self._done:
            try:
                copy = copy_on(self.model, on_meta)
                with HeadReshapes(copy, self.attention) as recorded:
                    ran = _run(copy, self.inputs, on_meta) is None
                self._done[on_meta] = ran, recorded.seen
            except Exception:  # noqa: BLE001 - a model that cannot be copied is not dry-run on that kind of copy
                self._done[on_meta] = False, {}
        return self._done[on_meta]


def _try(model, styles, details, analysis, world, sequence_parallel, inputs, on_meta: bool, whole: _Whole,
         clean: bool = False) -> Failure | None:
    """The first failure of the converted forward over the ranks in order (every rank runs them all, so all
    ranks reach the same plan without communicating): an error, or a split attention block whose reshapes to
    heads changed their size from the whole model's (see `head_reshapes.py`). A rank whose local shapes are all
    those of a rank before it is not run again. `clean`: None only for a pass that checked everything (a layer
    that cannot be built, or head sizes with no whole model's to compare, raise `_Unclear`)."""
    pairs = watched(analysis.pairs, {n for n, s in styles.items() if s != REPLICATE})
    seen, modules = set(), dict(model.named_modules())
    for rank in range(world):
        shapes = _local_shapes(modules, styles, details, analysis, world, rank)
        if shapes in seen:
            continue
        seen.add(shapes)
        try:
            copy = copy_on(model, on_meta)
            copy_analysis = _of_copy(copy, analysis)
        except Exception as exc:  # noqa: BLE001
            if not on_meta:
                raise
            raise _NoCopy() from exc
        prepared = prepare(copy, styles, details, copy_analysis, world, rank, sequence_parallel)
        try:
            swap(copy, prepared, ShapeCommunicator(rank, world))
        except Exception as exc:  # noqa: BLE001 - a layer that cannot be built on meta: the dry run cannot tell
            if clean:
                raise _Unclear() from exc
            return None
        with HeadReshapes(copy, pairs) as local:
            failure = _run(copy, inputs, on_meta)
        if failure is not None:
            return failure
        sizes = whole.heads(on_meta) if any(local.seen.values()) else None
        if clean and sizes is None and any(local.seen.values()):
            raise _Unclear()
        wrong = changed(sizes, local.seen, pairs) if sizes is not None else None
        if wrong is not None:
            return (wrong[0],), f"wrong heads: {wrong[1]}"
    return None


def _local_shapes(modules, styles, details, analysis, world: int, rank: int) -> tuple:
    layouts = plan_layouts(modules, analysis.leaves, styles, details, world, rank)
    return tuple(sorted((n, k, tuple(lay.local_shape)) for n, per in layouts.items() for k, lay in per.items()))


def keep_whole(styles: dict[str, str], reasons: dict[str, str], blocks: Iterable[str], reason: str,
               analysis: Analysis) -> None:
    """Every layer inside `blocks` (and whatever shares a weight or a column -> row pair with one) replicated in
    `styles`, with `reason` in `reasons`; entries of containers inside them (regions) dropped."""
    whole = {n for n in _names_under(blocks, styles)}
    whole |= {t for n in whole for t in analysis.ties.get(n, ())}
    for pair in analysis.pairs:  # a column -> row pair is split whole or not at all
        members = {*pair.columns, pair.row, *pair.carried, *pair.per_head}
        if members & whole:
            whole |= members
    for n in sorted(whole):
        if n in analysis.leaves:
            if styles.get(n) != REPLICATE:
                reasons[n] = reason
            styles[n] = REPLICATE
        else:
            styles.pop(n, None)


def _splits(styles: Mapping[str, str]) -> bool:
    return any(s != REPLICATE for s in styles.values())


def _names_under(blocks: Iterable[str], names: Iterable[str]) -> list[str]:
    blocks = list(blocks)
    return [n for n in names if any(b == "" or n == b or n.startswith(b + ".") for b in blocks)]


def _owner(running: tuple, styles: Mapping[str, str]) -> str:
    """The innermost running module that holds a split layer (the model itself when none does)."""
    split = [n for n, s in styles.items() if s != REPLICATE]
    for name in reversed(running):
        if name and any(n.startswith(name + ".") for n in split):
            return name
    return ""


def _blocks(model: nn.Module, owner: str) -> list[str]:
    """`owner` and the modules of its class at the same place in the other repeated blocks (`layers.0.attn`:
    every `layers.<i>.attn`)."""
    if not owner:
        return [""]
    pattern = re.compile(r"\.".join(r"\d+" if p.isdigit() else re.escape(p) for p in owner.split(".")) + "$")
    kind = type(model.get_submodule(owner))
    return [n for n, m in model.named_modules() if n and pattern.match(n) and type(m) is kind]


def _of_copy(copy: nn.Module, analysis: Analysis) -> Analysis:
    """`analysis` for `copy`, a copy of its model (`trace.structure.copy_on`)."""
    modules = dict(copy.named_modules())
    leaves = {n: modules[n] for n in analysis.leaves}
    return dataclasses.replace(analysis, model=copy, leaves=leaves)


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, Mapping):
        return {k: _to_meta(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    return x


def _to_real(x: Any) -> Any:
    """`x` with tensors on the meta device as zeros on the CPU (the inputs of a meta model's trace)."""
    if isinstance(x, torch.Tensor):
        return torch.zeros(x.shape, dtype=x.dtype) if x.device.type == "meta" else x
    if isinstance(x, Mapping):
        return {k: _to_real(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_real(v) for v in x)
    return x


def _run(model: nn.Module, inputs: Any, on_meta: bool) -> Failure | None:
    """One eval forward of `model` on `inputs` (meta copies of them when `on_meta`); None, or where it failed
    and why."""
    running: list[str] = []
    left: dict[int, tuple] = {}  # id of each exception: (it, the running modules when it left the innermost one)
    handles = []

    def popped(*_):  # on a return and on a raise (`always_call`): a child that raised and was caught has left
        exc = sys.exc_info()[1]
        if exc is not None and id(exc) not in left:  # (by id: an exception class may define __eq__ unhashably)
            left[id(exc)] = exc, tuple(running)
        running.pop()

    for name, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(lambda *_, n=name: running.append(n)))
        handles.append(m.register_forward_hook(popped, always_call=True))
    model.eval()
    args = _to_meta(inputs) if on_meta else _to_real(inputs)
    try:
        with torch.no_grad(), traceable_experts(model.modules()):
            if isinstance(args, Mapping):
                model(**args)
            elif isinstance(args, torch.Tensor):
                model(args)
            else:
                model(*args)
    except Exception as exc:  # noqa: BLE001 - any failure of the forward is the finding
        place = left[id(exc)][1] if id(exc) in left else tuple(running)
        return place, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    finally:
        left.clear()  # the exceptions' tracebacks hold this frame, and with it the model's copy
        for h in handles:
            h.remove()
    return None
