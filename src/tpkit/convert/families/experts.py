"""Mixture-of-experts layers: finding fused expert weights, planning them, and their two styles.

Transformers 5 keeps a MoE layer's experts as one module holding 3-D parameters, experts x out x in:
`gate_up_proj` [E, 2I, H] (gate and up stacked, two pieces) and `down_proj` [E, H, I], or `up_proj` without a
gate, or both stored transposed (`is_transposed`). Its forward takes `(hidden_states, top_k_index,
top_k_weights)` from a router that stays whole. Two styles split it:

- `experts_tp` (the automatic choice): tensor parallelism inside every expert. Each rank holds every
  expert's slice of the intermediate features: gate and up by rows, each piece on its own; down by columns.
- `experts_ep`: expert parallelism. Each rank holds whole experts, divided by the split rule (8 experts on 3
  ranks: 3, 3, 2); the router's choices of other ranks' experts are skipped.

Either way a rank's combined output is a partial sum of the layer's, so the layer does one all-reduce after
its combine (`tpkit.nn.experts.ExpertsRegion`). The module keeps its own forward and state_dict keys.
Anything else (expert biases, interleaved gate/up, a custom gate function, a forward of another shape) is
left whole, with the reason in the plan.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Iterator

from torch import nn

from ...layout import Piece, ShardLayout
from ...nn.experts import ExpertsRegion
from ...nn.quantized_experts import copy_with
from ..errors import PlanError
from ..family import Choice, Draft, Family, Proposal
from ..roles import Role
from ..styles import Layouts, Style

EXPERTS_TP = "experts_tp"
EXPERTS_EP = "experts_ep"
_UP_NAMES = ("gate_up_proj", "up_proj")
_WIDTH_ATTRS = ("intermediate_dim", "intermediate_size", "expert_dim", "moe_intermediate_size")
_COUNT_ATTRS = ("num_experts", "num_local_experts")


@dataclasses.dataclass(frozen=True)
class FusedExperts:
    """The layout of a fused experts module: E experts, hidden size H, intermediate size I."""

    up: str               # "gate_up_proj" (gate and up stacked: two pieces) or "up_proj"
    num_experts: int
    hidden: int
    intermediate: int
    transposed: bool      # stored experts x in x out
    names: tuple          # the forward's parameter names for (hidden, expert index, expert weights)

    @property
    def pieces(self) -> int:
        return 2 if self.up == "gate_up_proj" else 1


def fused_experts(m: nn.Module) -> FusedExperts | str | None:
    """The module's fused-experts layout; a reason string when it looks like one tpkit cannot split exactly;
    None when it is not a fused experts module at all."""
    params = dict(m.named_parameters(recurse=False))
    up = next((n for n in _UP_NAMES if n in params), None)
    if up is None or "down_proj" not in params or any(p.dim() != 3 for p in params.values()):
        return None
    where = f"{type(m).__name__} (fused experts)"
    extra = sorted(set(params) - {up, "down_proj"})
    if extra:
        return f"{where}: parameters {extra} besides {up}/down_proj (expert biases) are not split; replicated"
    if not getattr(m, "is_concatenated", True):
        return f"{where}: gate and up are interleaved, not stacked as two pieces; replicated"
    if getattr(m, "has_post_expert_norm", False):
        return f"{where}: a norm after each expert needs its whole output; replicated"
    gate = getattr(type(m), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
        return f"{where}: a custom gate function ({type(m).__name__}._apply_gate) may mix gate and up; replicated"
    names = _forward_names(type(m))
    if names is None:
        return f"{where}: its forward is not (hidden_states, expert_index, expert_weights); replicated"
    transposed = bool(getattr(m, "is_transposed", False))
    k = 2 if up == "gate_up_proj" else 1
    u, d = tuple(params[up].shape), tuple(params["down_proj"].shape)
    e, h, i = u[0], (u[1] if transposed else u[2]), d[1] if transposed else d[2]
    want_u = (e, h, k * i) if transposed else (e, k * i, h)
    want_d = (e, i, h) if transposed else (e, h, i)
    if u != want_u or d != want_d:
        return f"{where}: {up} {list(u)} and down_proj {list(d)} are not experts x out x in of one size; replicated"
    return FusedExperts(up, e, h, i, transposed, names)


def experts_in(model: nn.Module) -> tuple[list[tuple[str, FusedExperts]], list[str]]:
    """`(every fused experts module of `model` with its layout, by name; "name: why" for each module that looks like
    one but cannot be split exactly)`."""
    found, refused = [], []
    for name, m in model.named_modules():
        info = fused_experts(m)
        if isinstance(info, str):
            refused.append(f"{name}: {info}")
        elif info is not None:
            found.append((name, info))
    return found, refused


def _forward_names(cls: type) -> tuple | None:
    try:
        params = list(inspect.signature(cls.forward).parameters)[1:]
    except (TypeError, ValueError):
        return None
    if len(params) != 3 or not any(s in params[1] for s in ("index", "indices", "ids")) or not any(
            s in params[2] for s in ("weight", "score", "prob")):
        return None
    return tuple(params)


def _info(name: str, m: nn.Module) -> FusedExperts:
    info = fused_experts(m)
    if not isinstance(info, FusedExperts):
        why = info or f"{type(m).__name__} is not a fused experts module (3-D gate_up_proj / up_proj and down_proj)"
        raise PlanError(f"{name}: {why}")
    return info


def expert_layouts(m: nn.Module, world: int, rank: int, expert_parallel: bool) -> Layouts:
    """This rank's part of the experts' weights: whole experts (dim 0) under expert parallelism; otherwise
    every expert's intermediate features, gate and up each split on its own."""
    info = _info(type(m).__name__, m)
    up_shape, down_shape = tuple(getattr(m, info.up).shape), tuple(m.down_proj.shape)
    if expert_parallel:
        return {info.up: ShardLayout.split(up_shape, 0, world, rank),
                "down_proj": ShardLayout.split(down_shape, 0, world, rank)}
    i = info.intermediate
    up_dim, down_dim = (2, 1) if info.transposed else (1, 2)
    # transformers' `grouped_mm` kernel needs every row stride a multiple of 16 bytes: split in whole units
    # of 16 bytes of a 2-byte dtype (8 features) where that leaves each rank some, else of a 4-byte one, ...
    unit = next(u for u in (8, 4, 2, 1) if i % u == 0 and i // u >= world)
    pieces = tuple(Piece.split(n * i, i, world, unit) for n in range(info.pieces))
    return {info.up: ShardLayout(up_shape, world, rank, up_dim, pieces),
            "down_proj": ShardLayout(down_shape, world, rank, down_dim, (Piece.split(0, i, world, unit),))}


def build_experts(m: nn.Module, layouts: Layouts, comm, expert_parallel: bool, quant=None) -> nn.Module:
    """A copy of `m` holding this rank's shards (`quant`: the parameters a checkpoint stores quantized, by name,
    held as its stored tensors: `tpkit.nn.quantized_experts`), its forward wrapped in one experts region."""
    info = _info(type(m).__name__, m)
    new = copy_with(m, layouts, quant or {})
    experts = None
    if expert_parallel:
        seg = layouts["down_proj"].segments()
        first, count = (seg[0][0], seg[0][1] - seg[0][0]) if seg else (0, 0)
        experts = (first, count)
        _set_equal(new, _COUNT_ATTRS, info.num_experts, count)
        if hasattr(new, "_is_expert_parallel"):  # transformers' kernels then mask the sentinel expert
            new._is_expert_parallel = True
    else:
        _set_equal(new, _WIDTH_ATTRS, info.intermediate, layouts["down_proj"].local_shape[layouts["down_proj"].dim])
    return ExpertsRegion(comm, info.names, experts).install(new)


def _set_equal(m: nn.Module, attrs, full: int, local: int) -> None:
    for a in attrs:
        v = getattr(m, a, None)
        if isinstance(v, int) and not isinstance(v, bool) and v == full:
            setattr(m, a, local)


class ExpertsTP(Style):
    name = EXPERTS_TP
    description = ("fused experts (experts x out x in): every expert's gate/up split by rows (two pieces), down by "
                   "columns; router whole; one all-reduce after the combine")
    collectives = ("all_reduce",)
    expert_parallel = False
    splits = True
    builds_quantized = True  # `quant_method`: {parameter: ExpertsQuantMethod}

    def check(self, name: str, m: nn.Module, role: Role | None, world: int) -> None:
        info = _info(name, m)
        n = info.num_experts if self.expert_parallel else info.intermediate
        what = "experts" if self.expert_parallel else "intermediate features per expert"
        if n < world:
            other = EXPERTS_TP if self.expert_parallel else EXPERTS_EP
            raise PlanError(f"{name} ({type(m).__name__}): {n} {what} cannot be split over {world} ranks; use a world "
                            f"size <= {n}, style {other!r}, or 'replicate'")

    def layouts(self, m: nn.Module, role: Role | None, world: int, rank: int) -> Layouts:
        return expert_layouts(m, world, rank, self.expert_parallel)

    def build(self, m: nn.Module, layouts: Layouts, comm, sequence_parallel: bool = False,
              quant_method=None) -> nn.Module:
        return build_experts(m, layouts, comm, self.expert_parallel, quant_method)


class ExpertsEP(ExpertsTP):
    name = EXPERTS_EP
    description = ("fused experts divided over the ranks (expert parallelism, split rule): a rank runs only its own "
                   "experts; router whole; one all-reduce after the combine")
    expert_parallel = True


ROUTER_REASON = "the router of the experts beside it: whole, so every rank routes alike (small)"


class FusedExpertsFamily(Family):
    """Every fused experts module not planned before: tensor parallelism inside every expert by default, expert
    parallelism as the alternative, or whole with the reason."""

    name = "fused_experts"
    styles = (ExpertsTP(), ExpertsEP())

    def detect(self, analysis) -> list[tuple[str, FusedExperts | str]]:
        return [(n, info) for n, m in analysis.leaves.items() if (info := fused_experts(m)) is not None]

    def propose(self, draft: Draft, found: list[tuple[str, FusedExperts | str]]) -> Iterator[Proposal]:
        world = draft.world_size
        for name, info in found:
            if draft.style(name) is not None:
                continue
            if isinstance(info, str):
                yield Proposal(self.name, name, (Choice("whole", reasons={name: info}),))
                continue
            routers = self._routers(draft, name, info)
            tp = Choice("experts TP", {name: EXPERTS_TP}, reasons=routers)
            ep = [Choice("experts EP", {name: EXPERTS_EP}, reasons=routers)] if info.num_experts >= world else []
            if info.intermediate >= world:
                yield Proposal(self.name, name, (tp, *ep, Choice("whole", reasons={name: "kept whole by the chosen "
                                                                                         "setup"})))
            else:
                why = (f"{info.intermediate} intermediate features per expert cannot be split over {world} ranks "
                       f"(style {EXPERTS_EP!r} divides the {info.num_experts} experts instead)")
                yield Proposal(self.name, name, (Choice("whole", reasons={name: why}), *ep))

    @staticmethod
    def _routers(draft: Draft, name: str, info: FusedExperts) -> dict[str, str]:
        """The router beside the experts ([experts, hidden], not planned yet), with why it stays whole."""
        parent = name.rpartition(".")[0]
        out = {}
        for other, r in draft.analysis.leaves.items():
            w = getattr(r, "weight", None)
            if (other.rpartition(".")[0] == parent and draft.style(other) is None and w is not None
                    and tuple(w.shape) == (info.num_experts, info.hidden)):
                out[other] = ROUTER_REASON
        return out
