"""Norms over all of a split vector's features, run whole on the features gathered from every rank.

OLMo-2 normalises the whole query projection (`q_norm(q_proj(x))`, over heads x head_dim) before cutting it into
heads; BitNet normalises the attention output before o_proj and the MLP's product before down_proj. Such a norm
sits between a column-wise and a row-wise layer but needs every feature, so without help the whole block stays
replicated. As vLLM does for OLMo-2, each rank all-gathers the split features just before the norm, runs the norm
whole, and keeps its own features of the output: the layers around it stay split, at the cost of one all-gather
of that activation. The backward of that gather is a reduce-scatter (each rank's slice of the output feeds a
different computation), so gradients are exact; the norm's weight sees only this rank's features of the output,
so its gradient is summed over the ranks.

The trace finds the norms (`trace/pairs.py::_through_norms`); the attention and MLP families plan them with their
pair (`gathered_sizes` says whether the split lets them); this family checks the plan and installs the hooks.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ...nn.grad_sums import sum_grads
from ...nn.mappings import gather_from_sequence_region
from ..errors import PlanError
from ..family import Checked, Family, Planned
from ..modules import is_feature_norm, kind
from ..roles import Role
from ..styles import COLWISE, ROWWISE, ColWise, RowWise, Style

GATHERED_NORM = "gathered_norm"


class GatheredNorm(Style):
    name = GATHERED_NORM
    description = ("a norm over all features between a column-wise and a row-wise layer: every rank holds it whole, "
                   "runs it on the features gathered from every rank and keeps its own features of the output")
    collectives = ("all_gather", "reduce_scatter (backward)", "all_reduce (weight gradient)")
    split_input = split_output = True

    def check(self, name: str, m: nn.Module, role: Role | None, world: int) -> None:
        if not is_feature_norm(m):
            raise PlanError(f"{name} ({kind(m)}): style {GATHERED_NORM!r} needs a norm over the last dimension "
                            f"(LayerNorm, RMSNorm)")

    def check_dataflow(self, name: str, planned: Any, lookup) -> None:
        if planned.world_size > 1 and not any(name in p.norms for p in planned.analysis.pairs):
            raise PlanError(f"{name}: style {GATHERED_NORM!r} is for a norm over all features between column-wise "
                            f"layers and their row-wise partner; the trace does not show {name} as one")


def gathered_sizes(role: Role, leaves: Mapping[str, nn.Module], roles: Mapping[str, Role],
                   world: int) -> tuple[int, ...] | str:
    """Every rank's number of the norm's features under the split it follows (`role.columns`: the one column it
    normalises, else its row's input), or why they cannot be gathered: a rank must hold one contiguous block, in
    rank order (KV heads shared by several ranks or packed pieces are not)."""
    source = role.columns[0] if role.columns else role.row
    style = ColWise() if role.columns else RowWise()
    lay = style.layouts(leaves[source], roles.get(source), world, 0)["weight"]
    edge, sizes = 0, []
    for r in range(world):
        segments = lay.segments(r)
        if len(segments) > 1 or (segments and segments[0][0] != edge):
            return (f"{source}'s split at {world} ranks holds its features as {[lay.segments(q) for q in range(world)]}, "
                    f"not one block per rank in rank order, so they cannot be gathered for the norm")
        sizes.append(segments[0][1] - edge if segments else 0)
        edge += sizes[-1]
    return tuple(sizes)


def norms_blocker(draft, pair) -> str | None:
    """Why the pair's gathered norms keep it whole at the draft's world size, or None."""
    roles = draft.analysis.structures
    for n in pair.norms:
        found = gathered_sizes(roles[n], draft.analysis.leaves, roles, draft.world_size)
        if isinstance(found, str):
            return f"the norm {n} over all features between {list(pair.columns)} and {pair.row}: {found}"
    return None


class GatherForNorm:
    """Forward pre-hook and hook of a gathered norm: all-gather the input's features, keep this rank's of the
    output."""

    def __init__(self, sizes: tuple[int, ...], rank: int, comm):
        self.sizes, self.comm = tuple(sizes), comm
        self.start, self.size = sum(sizes[:rank]), sizes[rank]

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (gather_from_sequence_region(args[0], self.comm, -1, self.sizes),) + tuple(args[1:]), kwargs
        key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        return args, {**kwargs, key: gather_from_sequence_region(kwargs[key], self.comm, -1, self.sizes)}

    def after(self, module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return out.narrow(-1, self.start, self.size)


class GatheredNorms(Family):
    name = "gathered_norms"
    styles = (GatheredNorm(),)

    def validate(self, planned: Planned) -> Checked | None:
        """Each gathered norm's per-rank sizes, from the split of the layer it follows (which must be planned)."""
        norms = [n for n, s in planned.styles.items() if s == GATHERED_NORM]
        if planned.world_size == 1 or not norms:
            return None
        sizes = {}
        for n in norms:
            role = planned.details.get(n)
            source = (role.columns[0] if role.columns else role.row) if role is not None else None
            wanted = COLWISE if role is not None and role.columns else ROWWISE
            if source is None or planned.style_of(source) != wanted:
                raise PlanError(f"{n} is {GATHERED_NORM!r} but the layer whose split its features follow "
                                f"({source or 'none recorded'}) is not {wanted!r}; plan the pair together")
            found = gathered_sizes(role, planned.analysis.leaves, planned.details, planned.world_size)
            if isinstance(found, str):
                raise PlanError(f"{n}: {found}; plan its pair 'replicate'")
            sizes[n] = found
        return Checked(state=sizes)

    def install(self, model: nn.Module, planned: Planned, checked: Checked | None, comm) -> None:
        if checked is None:
            return
        for name, sizes in checked.state.items():
            m = model.get_submodule(name)
            hook = GatherForNorm(sizes, planned.rank, comm)
            m.register_forward_pre_hook(hook.before, with_kwargs=True)
            m.register_forward_hook(hook.after, with_kwargs=True)
            sum_grads(m, [n for n, p in m.named_parameters(recurse=False)], comm)
