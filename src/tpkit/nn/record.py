"""The record of a model's parameters: every fact tpkit keeps about them, by state-dict key, on the model.

Why not on the tensors: every path that replaces a Parameter object (`load_state_dict(assign=True)`, `to_empty`,
`swap_tensors`, FSDP2) drops whatever was set on the old one, without a trace, and a fact lost there is a silently
wrong gradient norm or a silently partial gradient. So the facts live on the model, by name, and whatever Parameter
sits under a name now is the one they are about (as torch's `parametrize` keeps its registry by name).

A `ModelRecord` sits in the model's `__dict__` (`attach_record`; `tpkit.parallelize` attaches its `Conversion`,
which is one) and holds:
- `comm`: the tensor-parallel communicator of the model's layers (None: an unconverted model);
- `layouts`: state-dict key -> `ShardLayout` (which part of the full tensor this rank holds; the entries several
  ranks hold, such as KV rows, follow from it); a PEFT adapter's keys follow their base layer's
  (`adapter_layouts.py`);
- `data_parallel`: what `tpkit.data_parallel` keeps (engine, dp communicator), or None;
- `pipeline`: what `tpkit.pipeline` keeps when the model is this rank's stages of a pipeline (pipeline group,
  split, tied copies), or None;
- `context`: what `tpkit.context_parallel` keeps (the cp group, each attention layer's method and why), or None.
How a parameter enters its module's forward (a gradient summed over ranks, a weight stored quantized) is a rewrite
registered on the module that owns it, by name (`rewrites.py`): the mechanism must sit where the forward runs.

Bare parameters (`clip_grad_norm_(model.parameters())`) find their record by identity: every live record is
registered (weakly), and a parameter belongs to the record whose owner holds it now, under the key it holds it by.
`copy.deepcopy` and pickling carry the record with the model (its `owner` follows the copy) and the copy registers
itself. The record refers to its model weakly: a model that holds its record strongly and is held by it would be
freed only by the cycle collector, and `del model` must give its memory back at once. A tpkit layer used outside any record (a model built from `tpkit.nn` layers by hand) declares which of its
parameters are split and along which dim (`split_dims()`); everything else is whole on every rank.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..layout import ShardLayout
from .adapter_layouts import adapter_layout

_ATTR = "_tp_record"
_LOCK = threading.Lock()
_RECORDS: "weakref.WeakSet[ModelRecord]" = weakref.WeakSet()
_SHARDED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


@dataclasses.dataclass(eq=False)
class ModelRecord:
    """Every fact tpkit keeps about the parameters of the module it is attached to (`owner`), by state-dict key."""

    comm: Communicator | None
    layouts: Mapping[str, ShardLayout]
    data_parallel: Any = dataclasses.field(default=None, kw_only=True)
    pipeline: Any = dataclasses.field(default=None, kw_only=True)  # `tpkit.pipeline`'s facts: the model is one stage
    context: Any = dataclasses.field(default=None, kw_only=True)  # `tpkit.context_parallel`'s facts (cp group, methods)
    experts: Any = dataclasses.field(default=None, kw_only=True)  # `tpkit.expert_parallel`'s facts (ep / edp groups)
    _owner: Any = dataclasses.field(default=None, repr=False, kw_only=True)  # a weakref to the module

    @property
    def owner(self) -> nn.Module | None:
        """The module the record is attached to (None once it is gone)."""
        return self._owner() if self._owner is not None else None

    @owner.setter
    def owner(self, module: nn.Module | None) -> None:
        self._owner = weakref.ref(module) if module is not None else None

    @property
    def world_size(self) -> int:
        return 1 if self.comm is None else self.comm.world_size

    @property
    def rank(self) -> int:
        return 0 if self.comm is None else self.comm.rank

    def layout(self, key: str, shape: Iterable[int]) -> ShardLayout:
        """The layout of `key` (a state-dict key of the owner) holding a tensor of `shape` on this rank (whole when
        the record says nothing of it)."""
        lay = self.known_layout(key, shape)
        return lay if lay is not None else ShardLayout.replicated(tuple(shape), self.world_size, self.rank)

    def known_layout(self, key: str, shape: Iterable[int]) -> ShardLayout | None:
        """The layout the record holds for `key` (a PEFT adapter's: from its base layer's), or None."""
        lay = self.layouts.get(key)
        if lay is None and self.layouts:
            lay = adapter_layout(key, self.layouts, tuple(shape), self.world_size, self.rank)
        return lay

    def parameter_keys(self) -> dict[int, str]:
        """`{id(parameter): state-dict key}` of the parameters the owner holds now (a tied one under its first key)."""
        out: dict[int, str] = {}
        if self.owner is not None:
            for key, p in self.owner.named_parameters(remove_duplicate=False):
                out.setdefault(id(p), key)
        return out

    def __getstate__(self) -> dict:  # the owner itself: a copy of the model refers to the copy (memo), a pickle to
        state = dict(self.__dict__)   # the unpickled model
        state["_owner"] = self.owner
        return state

    def __setstate__(self, state: dict) -> None:  # a deep copy or an unpickled model's record: findable again
        owner = state.pop("_owner", None)
        self.__dict__.update(state)
        self.owner = owner
        _register(self)


def _register(record: ModelRecord) -> None:
    with _LOCK:
        _RECORDS.add(record)


def attach_record(module: nn.Module, record: ModelRecord) -> ModelRecord:
    """Keep `record` on `module` (replacing one it held) as the record of `module`'s parameters."""
    record.owner = module
    module.__dict__[_ATTR] = record
    _register(record)
    return record


def record_of(module: nn.Module) -> ModelRecord | None:
    """The record `module` itself holds (not one a wrapper forwards to: PEFT's wrappers forward attributes)."""
    return module.__dict__.get(_ATTR)


def records_in(module: nn.Module) -> list[tuple[str, ModelRecord]]:
    """`(submodule name, record)` of every record inside `module` (itself included, as "")."""
    return [(n, r) for n, m in module.named_modules() if (r := record_of(m)) is not None]


def find_record(module: nn.Module, where: str) -> tuple[str, ModelRecord] | None:
    """The one record inside `module` with its submodule name (a model wrapped after conversion, by DDP or PEFT,
    holds it below the wrapper), or None; two records (two models converted apart) raise, naming them."""
    found = records_in(module)
    if len(found) > 1:
        raise ValueError(f"{where}: the model holds {len(found)} converted submodules ({[n for n, _ in found]}); "
                         f"call it on each")
    return found[0] if found else None


def communicator_of(module: nn.Module) -> Communicator | None:
    """The tensor-parallel communicator of `module`: its record's, else its tpkit layers' (which must agree);
    None for a model with neither. The one place that question is answered."""
    found = find_record(module, "communicator_of")
    if found is not None and found[1].comm is not None:
        return found[1].comm
    comms = {id(c): c for m in module.modules() if (c := getattr(m, "comm", None)) is not None
             and isinstance(m, SplitsParameters)}
    if len(comms) > 1:
        raise ValueError(f"the model's tensor-parallel layers use {len(comms)} different communicators; convert it "
                         f"once, with one tensor-parallel communicator")
    return next(iter(comms.values()), None)


# ------------------------------------------------------------------------------------------------------------
# Bare parameters.

class SplitsParameters:
    """A module (tpkit's layers, a LoRA adapter on one) that says which of its own parameters are split and along
    which dim (`split_dims`, names relative to it), for parameters no record holds: a model built by hand."""

    def split_dims(self) -> dict[str, int]:
        raise NotImplementedError

    def _declare_split(self) -> None:
        with _LOCK:
            _SHARDED.add(self)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who says how a parameter is held: the record that holds it (and its key there), and the dim along which a
    layer that splits it cut it (for a record that says nothing of the key: a model built from layers by hand)."""

    record: ModelRecord | None = None
    key: str = ""
    dim: int | None = None

    def layout(self, p: torch.Tensor) -> ShardLayout | None:
        """What the record says of the parameter, or None."""
        return None if self.record is None else self.record.known_layout(self.key, p.shape)


def holders(params: Iterable[torch.Tensor]) -> dict[int, Holder]:
    """`{id(p): Holder}` of the parameters among `params` that a live record or a splitting layer holds now."""
    wanted = {id(p) for p in params}
    found: dict[int, tuple[ModelRecord, str]] = {}
    dims: dict[int, int] = {}
    with _LOCK:
        records, sharded = list(_RECORDS), list(_SHARDED)
    for record in records:
        for pid, key in record.parameter_keys().items():
            if pid in wanted:
                found.setdefault(pid, (record, key))
    for m in sharded:
        for name, dim in m.split_dims().items():
            p = _parameter(m, name)
            if p is not None and id(p) in wanted:
                dims.setdefault(id(p), dim)
    return {pid: Holder(*found.get(pid, (None, "")), dim=dims.get(pid)) for pid in found.keys() | dims.keys()}


def _parameter(m: nn.Module, name: str) -> torch.Tensor | None:
    owner, _, leaf = name.rpartition(".")
    try:
        sub = m.get_submodule(owner) if owner else m
    except AttributeError:
        return None
    return sub._parameters.get(leaf)


def settle(records: Iterable[ModelRecord]) -> None:
    """Put every data-parallel engine of `records` back in its resting state (FSDP2 sharded), so the owners hold
    the Parameters an optimizer holds."""
    for r in records:
        if r.data_parallel is not None:
            r.data_parallel.reshard()


def live_records() -> list[ModelRecord]:
    with _LOCK:
        return list(_RECORDS)
