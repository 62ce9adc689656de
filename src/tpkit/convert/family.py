"""The `Family` protocol: one architecture pattern tpkit knows how to split, as one object the steps loop over.

A family is what an architecture adds to conversion (attention heads, MultiheadAttention, fused experts, MoE
blocks, per-head tensors, the vocabulary, sequence parallelism, fused fast paths, model-owned losses). The steps
of `parallelize` never import a family by name: they call every registered family (`registry.FAMILIES`, in
registry order) at fixed points, as PyTorch's checkpoint `LoadPlanner` is called by the loader:

1. trace     `detect(analysis) -> found`                what of the pattern the traced model holds (world-size
                                                        free; passed back to `propose`)
2. plan      `propose(draft, found) -> [Proposal]`      plan entries for each group of modules it owns, with the
                                                        alternatives (e.g. split by heads / whole); the planner
                                                        applies each proposal's chosen alternative to the draft
                                                        as soon as it is produced (a generator sees its own
                                                        earlier proposals applied), so later proposals and
                                                        families see what earlier ones decided
3. layouts   through the `styles` it registers          each `Style.check` and `Style.layouts`, per module
4. validate  `validate(planned) -> Checked | None`      plan-wide checks on the applied plan (raise PlanError);
                                                        may settle styles and keep a record for `install`
5. swap      `attributes(planned) -> {module: {a: v}}`  attribute values to set when the layers are swapped
                                                        (local head counts, fast paths off)
             `install(model, planned, checked, comm)`   after the new layers are in: hooks, losses, regions

Every method has a default that does nothing, so a family implements only its own steps. Adding a family is one
module and one line in `registry.FAMILIES` (or `registry.register_family(...)` from outside tpkit).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from .modules import is_conv2d, is_embedding, is_feature_norm, is_linear, is_per_channel, kind
from .roles import Role
from .styles import REPLICATE, SMALL, Style

NO_PARTNER = "no column -> row partner found in the dataflow"

if TYPE_CHECKING:
    from torch import nn

    from .trace import Analysis


@dataclasses.dataclass(frozen=True)
class Choice:
    """One way to plan a group of modules: their styles, the facts their layouts need, and why a module stays
    whole (a reason may also name a module the choice gives no entry, to explain the default replicate)."""

    label: str
    entries: Mapping[str, str] = dataclasses.field(default_factory=dict)
    details: Mapping[str, Role] = dataclasses.field(default_factory=dict)
    reasons: Mapping[str, str] = dataclasses.field(default_factory=dict)
    note: str = ""  # what taking it does, in words (for reports and the setup search)
    # its whole entries say only that no column -> row pairing keeps the layers' outputs split: a later family may
    # still split such a layer with a whole output (`families/lone_layers.py`)
    unpaired: bool = False


def whole_choice(names: Iterable[str], why: str, label: str = "whole", unpaired: bool = False) -> Choice:
    """Every one of `names` kept whole, each with the reason (`unpaired`: see `Choice`)."""
    names = tuple(names)
    return Choice(label, {n: REPLICATE for n in names}, reasons={n: why for n in names}, unpaired=unpaired)


@dataclasses.dataclass(frozen=True)
class Proposal:
    """A family's plan for one group of modules (`key`: an attention block, an experts module, ...): its
    alternatives, the first being the family's default."""

    family: str
    key: str
    choices: tuple[Choice, ...]

    def choice(self, label: str | None) -> Choice:
        """The alternative called `label` (None: the default)."""
        if label is None:
            return self.choices[0]
        for c in self.choices:
            if c.label == label:
                return c
        raise KeyError(f"{self.family} {self.key!r}: no alternative {label!r}; "
                       f"alternatives: {[c.label for c in self.choices]}")


class Draft:
    """The plan being made for one world size: what families decided so far, and every proposal made.

    `choose` maps a proposal key, or a family's name (every proposal of that family that has the alternative),
    to the alternative to take instead of the default (the setup search); a key wins over its family."""

    def __init__(self, analysis: "Analysis", world_size: int, mode: str, choose: Mapping[str, str] | None = None,
                 registry: Mapping[str, Style] | None = None):
        self.analysis, self.world_size, self.mode = analysis, world_size, mode
        self.registry = dict(registry or {})  # every style by name (`registry.STYLES`), as `Planned` has it
        self.entries: dict[str, str] = {}
        self.details: dict[str, Role] = {}
        self.reasons: dict[str, str] = {}
        self.proposals: list[Proposal] = []
        self.chosen: dict[str, str] = {}
        self.choose = dict(choose or {})
        self.unpaired: set[str] = set()  # kept whole only for want of a column -> row partner (see `Choice`)

    def style(self, name: str) -> str | None:
        return self.entries.get(name)

    def style_object(self, name: str) -> Style:
        """The `Style` module `name` is planned with so far (replicate when no family planned it)."""
        return self.registry.get(self.entries.get(name, REPLICATE), Style())

    def whole(self, names: Iterable[str]) -> tuple[str, str] | None:
        """(module, why) for the first of `names` an earlier family keeps whole, else None."""
        for n in names:
            if self.entries.get(n) == REPLICATE:
                return n, self.reasons.get(n, "kept whole")
        return None

    def pairless(self, name: str) -> bool:
        """Whether no family planned or explained `name`, or one kept it whole only for want of a column -> row
        partner (a router a family keeps whole by a reason alone is not pairless)."""
        return name in self.unpaired or (name not in self.entries and name not in self.reasons)

    def reason(self, name: str) -> str:
        """Why layer `name` is not split: the reason a family gave, else what the trace says about it."""
        if name in self.reasons:
            return self.reasons[name]
        a, m = self.analysis, self.analysis.leaves[name]
        if name not in a.trace.calls and name not in a.traced_alone:
            return "not run in the traced forward"
        if name in a.notes:
            return a.notes[name]
        if is_feature_norm(m):
            return "normalises over all features, so it needs the whole vector" + SMALL
        if is_per_channel(m):
            return "per-channel layer not between a column and a row conv" + SMALL
        if is_embedding(m):
            return "embedding not split"
        if is_linear(m) and name in a.trace.escaped:
            return "its output leaves the model; replicating avoids a gather" + SMALL
        if is_linear(m) or is_conv2d(m):
            return NO_PARTNER
        return f"{kind(m)}: no rule splits this layer type"

    def claimed(self, names: Iterable[str]) -> list[str]:
        """The modules of `names` an earlier family already planned (split or whole)."""
        return [n for n in names if n in self.entries]

    def apply(self, proposal: Proposal) -> Choice:
        """Take the proposal's chosen alternative: its entries and details in, reasons of modules it splits out,
        its own reasons in."""
        label = self.choose.get(proposal.key)
        if label is None and proposal.family in self.choose:
            wanted = self.choose[proposal.family]
            label = wanted if any(c.label == wanted for c in proposal.choices) else None
        choice = proposal.choice(label)
        self.proposals.append(proposal)
        self.chosen[proposal.key] = choice.label
        for name, s in choice.entries.items():
            held = name in self.entries and name not in self.unpaired  # whole for a reason of its own: stays so
            self.entries[name] = s
            if s == REPLICATE and choice.unpaired and not held:
                self.unpaired.add(name)
            else:
                self.unpaired.discard(name)
            if s != REPLICATE:
                self.reasons.pop(name, None)
        self.details.update(choice.details)
        self.reasons.update(choice.reasons)
        return choice


@dataclasses.dataclass(frozen=True)
class Planned:
    """A plan applied to one model on one rank, as validate and swap see it: every module's canonical style and
    role, the traced structure, and the conversion's options."""

    model: "nn.Module"
    analysis: "Analysis"
    styles: Mapping[str, str]
    details: Mapping[str, Role]
    world_size: int
    rank: int
    registry: Mapping[str, Style]  # every style by name (`registry.STYLES`), so families need not import it
    sequence_parallel: bool = False

    def style_of(self, name: str) -> str:
        """The canonical style of module `name` (replicate when the plan does not name it)."""
        return self.styles.get(name, REPLICATE)

    def style_object(self, name: str) -> Style:
        """The `Style` module `name` is planned with."""
        return self.registry[self.style_of(name)]


@dataclasses.dataclass(frozen=True)
class Checked:
    """What a family's validation settled for the steps after it: styles it fixed (sequence-parallel norms),
    extra keyword arguments for a module's `Style.build`, and a record of its own for `install`."""

    styles: Mapping[str, str] = dataclasses.field(default_factory=dict)
    build: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    state: Any = None


class Family:
    """An architecture pattern (see the module docstring for the call order). Subclasses set `name` and the
    `styles` they add to the one registry, and override the steps they take part in."""

    name: str = ""
    styles: tuple[Style, ...] = ()

    def detect(self, analysis: "Analysis") -> Any:
        return ()

    def propose(self, draft: Draft, found: Any) -> Iterable[Proposal]:
        return ()

    def validate(self, planned: Planned) -> Checked | None:
        return None

    def attributes(self, planned: Planned) -> Mapping[str, Mapping[str, Any]]:
        return {}

    def install(self, model: "nn.Module", planned: Planned, checked: Checked | None, comm) -> None:
        return None

    def __repr__(self) -> str:
        return f"<family {self.name}: styles {[s.name for s in self.styles]}>"
