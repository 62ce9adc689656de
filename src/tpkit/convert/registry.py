"""The one registry: every architecture family, in the order the planner asks them, and every plan style.

`FAMILIES` is the order families propose in (a family sees what earlier ones decided): layers read directly
first (they must stay whole), then the pairs the trace found, the tensors that follow their heads, the
vocabulary, and the mixture-of-experts patterns, which may plan over the per-layer entries. `STYLES` holds the
core styles and every family's, each name once. `register_family` adds a family from outside tpkit (a user's
architecture, or a test's), its styles with it; nothing else in tpkit changes.
"""
from __future__ import annotations

from typing import Iterator

from torch import nn

from .errors import PlanError
from .families.attention import Attention
from .families.expert_blocks import ExpertBlocks
from .families.experts import FusedExpertsFamily
from .families.fastpath import FastPaths
from .families.gathered_norms import GatheredNorms
from .families.head_params import HeadParameterFamily
from .families.lone_layers import LoneLayers
from .families.losses import ModelLosses
from .families.mha import MultiheadAttentions
from .families.mlp import FeaturePairs
from .families.per_head import PerHeadTensors
from .families.sequence import SequenceParallel
from .families.vocab import Vocabulary
from .family import Family
from .modules import is_embedding
from .styles import (ALIASES, COLWISE, CONTAINER_NO_OPS, CORE_STYLES, EMBEDDING_COLWISE, EMBEDDING_ROWWISE, ROWWISE,
                     Layouts, Style, replicated_layouts)

FAMILIES: list[Family] = [
    FastPaths(),            # layers other code reads directly stay whole: nothing later splits them
    Attention(),            # attention blocks split by heads
    FeaturePairs(),         # MLP and conv pairs
    GatheredNorms(),        # norms over all split features, run on the features gathered from every rank
    PerHeadTensors(),       # per-head tensors (T5's bias) with their attention; ALiBi arguments sliced
    HeadParameterFamily(),  # an attention module's own parameters (sinks, per-head biases) with its heads
    MultiheadAttentions(),  # torch.nn.MultiheadAttention
    Vocabulary(),           # LM heads, embeddings, tied weights
    ModelLosses(),          # losses models compute themselves
    ExpertBlocks(),         # MoE blocks of separate experts, as one region
    FusedExpertsFamily(),   # fused 3-D experts: TP inside each expert, or EP
    LoneLayers(),           # large layers no family paired: split by output features, output all-gathered
    SequenceParallel(),     # the residual stream split along the sequence
]

STYLES: dict[str, Style] = {}


def _add_styles(styles) -> None:
    """Add every one of `styles`, or none (a clash leaves the registry as it was)."""
    names = [s.name for s in styles]
    for s in styles:
        if s.name in STYLES or s.name in ALIASES or names.count(s.name) > 1:
            raise PlanError(f"style {s.name!r} is registered twice ({type(STYLES.get(s.name, s)).__name__} and "
                            f"{type(s).__name__}); give the new style another name")
    STYLES.update({s.name: s for s in styles})


_add_styles(CORE_STYLES + CONTAINER_NO_OPS + tuple(s for f in FAMILIES for s in f.styles))


_CHANGES = [0]  # families registered or unregistered since import


def generation() -> int:
    """How often the families changed since import: a value derived from plans (a traced step an estimate keeps)
    is stale once this moves."""
    return _CHANGES[0]


def register_family(family: Family, *, before: str | None = None) -> Family:
    """Add `family` (and its styles) to the registry: last, or just before the family named `before`."""
    if any(f.name == family.name for f in FAMILIES):
        raise PlanError(f"a family named {family.name!r} is already registered")
    names = [f.name for f in FAMILIES]
    if before is not None and before not in names:
        raise PlanError(f"register_family: no family {before!r} to go before; registered: {names}")
    _add_styles(family.styles)
    FAMILIES.insert(names.index(before) if before else len(FAMILIES), family)
    _CHANGES[0] += 1
    return family


def unregister_family(name: str) -> Family:
    """Remove the family called `name` and its styles (a plan naming them no longer parses)."""
    family = next((f for f in FAMILIES if f.name == name), None)
    if family is None:
        raise PlanError(f"no family {name!r} is registered")
    FAMILIES.remove(family)
    for s in family.styles:
        STYLES.pop(s.name, None)
    _CHANGES[0] += 1
    return family


def families() -> Iterator[Family]:
    """The registered families, in planning order (a copy: a family may be registered while iterating)."""
    return iter(list(FAMILIES))


def style(name: str) -> Style:
    """The style object of a canonical style name."""
    return STYLES[name]


def canonical_style(name: str, where: str = "plan") -> str:
    """The canonical name of a style string (case-insensitive; aliases accepted)."""
    if not isinstance(name, str):
        raise PlanError(f"{where}: style must be a string, got {name!r}")
    s = name.strip().lower()
    s = ALIASES.get(s, s)
    if s in STYLES:
        return s
    split = sorted(n for n, st in STYLES.items() if st.region or not st.container)  # not HF's no-op words
    raise PlanError(f"{where}: unknown style {name!r}; valid styles: {', '.join(split)} "
                    f"(aliases: {', '.join(sorted(ALIASES))})")


def for_module(name: str, m: nn.Module) -> str:
    """The style `name` means on module `m`. HF plans write 'rowwise' / 'colwise' on embeddings too (PyTorch's
    styles shard an embedding's weight by rows, the vocabulary, or by columns, its features): on an embedding
    they are the embedding styles, so every later check (ties, sizes, dataflow) sees one vocabulary."""
    if is_embedding(m) and name in (ROWWISE, COLWISE):
        return EMBEDDING_ROWWISE if name == ROWWISE else EMBEDDING_COLWISE
    return name


def module_layouts(m: nn.Module, style_name: str, role, world: int, rank: int) -> Layouts:
    """Every tensor `m` holds directly, as this rank holds it under `style_name` (all whole at world size 1)."""
    if world == 1:
        return replicated_layouts(m, world, rank)
    return style(for_module(style_name, m)).layouts(m, role, world, rank)
