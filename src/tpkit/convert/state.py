"""What `parallelize`'s steps hand each other: the user's request read once, one conversion state, and the rule that
a conversion runs each step once.

`Request` is the `plan=` argument read once, before anything is traced: the kind of plan asked for (the planner's,
the planner's with the user's entries over it, a whole plan, or a recorded one to apply as is), the user's entries
resolved against the model's module names (an entry naming no module raises here), and so which modules the user
fixed (a dry-run failure there is the user's PlanError, not a module kept whole). No later step reads `plan=` again.

`ConversionState` is one frozen record carried from step to step: each step returns it with what it found filled in
(`dataclasses.replace`), so no step recomputes what an earlier one knew. Its `view` is the model the plan is decided
on: the model itself, or the model cut to its distinct blocks (`trace.blocks.cut_view`), whose plan the expand
step gives every block.

`step` marks a step function; `steps_once()` opens one conversion's scope, inside which entering a step a second
time raises `StepReentered` (a conversion that goes round its own path is the tangle this layout removes). Scopes
are per thread (thread-ranks convert at once), and nest: a conversion inside another has its own.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

from torch import nn

from ..nn.record import SplitsParameters, record_of
from .errors import PlanError
from .plan import PLAN_WORDS, Plan, check_plan_argument
from .quantized import refuse_quantized
from .styles import SEQUENCE_PARALLEL
from .trace import base_prefix

AUTO, OVERRIDES, WHOLE, RECORDED = "auto", "overrides", "whole", "recorded"


@dataclasses.dataclass(frozen=True)
class Request:
    """The `plan=` argument, read once: `kind` (AUTO, OVERRIDES: the user's entries over the planner's, WHOLE: a plan
    the user wrote or saved, RECORDED: a plan this model was converted with before, applied without a trace), `user`
    (the user's entries, or the whole plan; None for AUTO) and `named` (the modules the user's entries name)."""

    kind: str
    user: Plan | None
    named: frozenset[str]

    def fixed(self, name: str) -> bool:
        """Whether the user's plan decided module `name` (every module, for a plan the user wrote whole)."""
        return self.kind in (WHOLE, RECORDED) or name in self.named


def read_request(plan: Any, modules: Mapping[str, nn.Module], world: int, recorded: bool = False,
                 sequence_parallel: bool = False) -> Request:
    """`plan` (see `parallelize`) as a `Request` for the model whose `modules` (by name, "" itself) a mapping's entries
    must name."""
    check_plan_argument(plan)
    if isinstance(plan, str) and plan in PLAN_WORDS:
        return Request(AUTO, None, frozenset())
    if isinstance(plan, Plan):  # recorded: applied untraced, unless made while the forward replaced modules
        whole = recorded and plan.world_size == world and not sequence_parallel and \
            SEQUENCE_PARALLEL not in plan.entries.values() and not plan.replaced_by_forward
        return Request(RECORDED if whole else WHOLE, plan.updated({}), frozenset())  # a copy: never filled in
    if isinstance(plan, (str, Path)):
        return Request(WHOLE, Plan.load(plan), frozenset())
    if isinstance(plan, Mapping):
        user = Plan.from_dict(plan)
        user.prefix = user.prefix or base_prefix(modules[""])
        named = frozenset(user.resolve([n for n in modules if n]))  # naming no module raises
        return Request(WHOLE if "entries" in plan else OVERRIDES, user, named)
    raise PlanError(f"parallelize: plan must be 'auto', a Plan, a mapping or a JSON path, got {type(plan).__name__}")


@dataclasses.dataclass(frozen=True)
class ConversionState:
    """One conversion on one rank, as far as its steps have gone (see the module doc). Fields after `adapters` are
    filled in by the steps, in order."""

    model: nn.Module                  # what is converted: the model, or PEFT's bare model (`without_adapters`)
    comm: Any
    mode: str
    request: Request
    example_inputs: Any = None
    sequence_parallel: bool = False
    reuse: bool | None = None         # plan reuse on a cut (None: the environment decides, `reuse.enabled`)
    quantization: Any = None          # a checkpoint's `QuantizedLayers`, a bare `Quantization`, or None
    adapters: Any = None              # PEFT's wrappers taken out (`peft.adapters.Adapters`), or None
    classes: Mapping[str, type] = dataclasses.field(default_factory=dict)  # every module's class at `begin`
    view: nn.Module | None = None     # the model the plan is decided on: `model`, or it cut to its distinct blocks
    blocks: tuple = ()                # the repeated blocks `view` cuts (empty when it is the model)
    outside: tuple = ()               # on a cut, the view's modules outside the blocks (`reuse.outside_blocks`)
    analysis: Any = None              # the `Analysis` of `view` (after `expand_plan`: of `model`)
    roles: Any = None                 # on a cut, the cut's roles renamed to every block (`expand_plan` uses them)
    plan: Plan | None = None          # resolved (module names, canonical styles) from `make_plan` on
    expanded: Plan | None = None      # on a cut, `plan` given to every block (dropped when the dry run changes it)
    prepared: Any = None              # `swap.Prepared`: this rank's layouts and styles
    updates: Mapping[str, Mapping[str, Any]] | None = None  # attributes set to local values by the swap

    @property
    def world(self) -> int:
        return self.comm.world_size

    @property
    def cut(self) -> bool:
        """Whether the plan is decided on the model cut to its distinct blocks."""
        return bool(self.blocks)


class StepReentered(RuntimeError):
    """A conversion entered one of its steps a second time."""


_DONE: contextvars.ContextVar[set | None] = contextvars.ContextVar("tpkit_conversion_steps", default=None)
F = TypeVar("F", bound=Callable)


@contextlib.contextmanager
def steps_once() -> Iterator[None]:
    """One conversion's scope: inside it, each `step` runs at most once."""
    token = _DONE.set(set())
    try:
        yield
    finally:
        _DONE.reset(token)


def step(fn: F) -> F:
    """Mark `fn` as a conversion step: a second call inside one `steps_once` scope raises `StepReentered`."""
    @functools.wraps(fn)
    def once(*args, **kwargs):
        done = _DONE.get()
        if done is not None:
            if fn.__name__ in done:
                raise StepReentered(f"conversion step {fn.__name__!r} entered twice in one conversion: each step "
                                    f"runs once, in order (convert/parallelize.py)")
            done.add(fn.__name__)
        return fn(*args, **kwargs)

    once.conversion_step = True
    return once  # type: ignore[return-value]


@step
def begin(model: nn.Module, plan: Any, comm, adapters: Any, **options) -> ConversionState:
    """The conversion's state before its first step: `plan` read once (`read_request`: an entry naming no module
    raises here); a model converted before or quantized by another library refused, and a plan that splits a
    LoRA-wrapped embedding along its features (`adapters.check_plan`)."""
    modules = dict(model.named_modules())  # walked once: the plan's names and both refusals read it
    request = read_request(plan, modules, comm.world_size, options.pop("recorded"), options["sequence_parallel"])
    refuse_quantized(modules, getattr(model, "config", None))
    done = [n or "the model" for n, m in modules.items()  # a record, or a layer holding shards
            if record_of(m) is not None or (isinstance(m, SplitsParameters) and m.split_dims())]
    if done:
        raise PlanError(f"parallelize: the model already holds tensor-parallel shards (e.g. {done[0]}); it was "
                        f"converted before (see its tp_plan). Convert the original model once per rank")
    if adapters is not None:
        adapters.check_plan(request.user)
    classes = {name: type(m) for name, m in modules.items()}
    return ConversionState(model, comm, request=request, adapters=adapters, classes=classes, **options)
