"""Mixture-of-experts blocks whose experts are separate modules (a ModuleList of small MLPs of nn.Linear).

Such a block combines its experts in its own forward (route, run the chosen experts, weight, add), so no
single layer sees the combined output. The block as a whole becomes one partial-sum region
(`tpkit.nn.experts.BlockRegion`, style `moe_block`): every expert's input projections hold their rows
(`expert_colwise`) and its output projection its columns (`expert_rowwise`), neither communicating; the
router stays whole; the block's output is all-reduced once, after the combine.

That is exact only if the block's output is a sum of its experts' outputs, weighted by replicated factors,
and nothing else: no residual, bias or norm added after the combine. With real weights that is checked before
anything changes, the way the ranks will compute it: the block run with each half of every output
projection's inputs must add up to the block run whole. Blocks that fail, or that hold other layers, stay to
the per-layer planner, with the reason.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
from torch import nn

from ...layout import ShardLayout
from ...nn.experts import BlockRegion
from ...nn.decode_linear import DecodeLinear
from ..errors import PlanError
from ..family import Checked, Choice, Draft, Family, Planned, Proposal
from ..roles import Role
from ..styles import REPLICATE, Layouts, Style

MOE_BLOCK = "moe_block"
EXPERT_COLWISE = "expert_colwise"
EXPERT_ROWWISE = "expert_rowwise"


@dataclasses.dataclass(frozen=True)
class ExpertBlock:
    name: str
    router: str
    columns: tuple[str, ...]  # every expert's input projections (hidden -> intermediate)
    rows: tuple[str, ...]     # every expert's output projection (intermediate -> hidden)
    intermediate: int


def _plain_linear(m: nn.Module) -> bool:
    return type(m) in (nn.Linear, DecodeLinear)  # (a conversion makes the Linear layers it keeps whole DecodeLinear)


def find_block(name: str, block: nn.Module) -> ExpertBlock | str | None:
    """The block's layout; a reason when it has separate experts but cannot be split as one region; None when
    it has no list of experts."""
    lists = [(c, m) for c, m in block.named_children() if isinstance(m, (nn.ModuleList, nn.ModuleDict))
             and len(m) >= 2 and len({type(e) for e in m.children()}) == 1]
    if len(lists) != 1:
        return None
    list_name, experts = lists[0]
    prefix = f"{name}.{list_name}" if name else list_name
    routers = [(c, m) for c, m in block.named_children() if _plain_linear(m) and m.out_features == len(experts)]
    if len(routers) != 1:
        return None
    router, hidden = routers[0][0], routers[0][1].in_features
    where = f"{name} ({type(block).__name__}, {len(experts)} separate experts)"
    cols, rows, widths = [], [], set()
    for ename, e in experts.named_children():
        owners = [(n, m) for n, m in e.named_modules() if any(True for _ in m.parameters(recurse=False))]
        if not owners or not all(_plain_linear(m) for _, m in owners):
            return f"{where}: expert {ename} holds layers other than nn.Linear; left to the per-layer planner"
        ins = [(n, m) for n, m in owners if m.in_features == hidden and m.out_features != hidden]
        outs = [(n, m) for n, m in owners if m.out_features == hidden and m.in_features != hidden]
        if len(outs) != 1 or not ins or len(ins) + 1 != len(owners):
            return (f"{where}: expert {ename} is not input projections {hidden} -> I and one output projection "
                    f"I -> {hidden}")
        if outs[0][1].bias is not None:
            return f"{where}: expert output projections with a bias are not split yet; left to the per-layer planner"
        widths |= {m.out_features for _, m in ins} | {outs[0][1].in_features}
        cols += [f"{prefix}.{ename}.{n}" for n, _ in ins]
        rows.append(f"{prefix}.{ename}.{outs[0][0]}")
    others = sorted(n for n, m in block.named_modules() if any(True for _ in m.parameters(recurse=False))
                    and n != router and not n.startswith(list_name + "."))
    if others:
        return f"{where}: it also holds {others}, which the block region does not split; left to the per-layer planner"
    if len(widths) != 1:
        return f"{where}: experts of different intermediate sizes {sorted(widths)}"
    full = lambda n: f"{name}.{n}" if name else n  # noqa: E731
    return ExpertBlock(name, full(router), tuple(cols), tuple(rows), widths.pop())


def probe(block: nn.Module, found: ExpertBlock) -> str | None:
    """None when the block's output is the sum of what two ranks would compute (each with half of every
    expert's intermediate features); otherwise why not. Runs the block three times; changes nothing."""
    weights = dict(block.named_parameters())
    w = next(iter(weights.values()))
    if w.is_meta:
        return None  # nothing to run: the structure is all there is to judge by
    hidden = block.get_submodule(found.router[len(found.name) + 1:] if found.name else found.router).in_features
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, hidden, generator=g, dtype=torch.float64).to(dtype=w.dtype, device=w.device)
    half = found.intermediate // 2
    local = lambda n: n[len(found.name) + 1:] if found.name else n  # noqa: E731
    outs = []
    for keep in (None, slice(0, half), slice(half, None)):
        over = {}
        for r in found.rows:
            key = local(r) + ".weight"
            masked = torch.zeros_like(weights[key]) if keep is not None else weights[key]
            if keep is not None:
                masked[:, keep] = weights[key][:, keep]
            over[key] = masked
        try:
            with torch.no_grad():
                out = torch.func.functional_call(block, over, (x,))
        except Exception as exc:  # noqa: BLE001 - a block we cannot run on a probe is not proven
            return f"the block could not be run on a probe input [2, 5, {hidden}] ({type(exc).__name__}: {exc})"
        outs.append(out[0] if isinstance(out, tuple) else out)
    whole, a, b = outs
    if not isinstance(whole, torch.Tensor) or not torch.allclose(a + b, whole, rtol=1e-4, atol=1e-5 * (
            whole.abs().max().item() + 1e-30)):
        return ("its output is not the sum of its experts' partial outputs (a residual, bias or norm after the "
                "combine?)")
    return None


class RegionLinear(nn.Linear):
    """An expert's projection holding this rank's shard, computing its part with no communication: right only
    inside a MoE block made one region (`moe_block`), which marks it; anywhere else it refuses to run rather
    than return a partial result."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "tp_block_region", False):
            raise RuntimeError(f"an {EXPERT_COLWISE}/{EXPERT_ROWWISE} layer ran outside a '{MOE_BLOCK}' region: "
                               f"plan its MoE block '{MOE_BLOCK}' too (tpkit.plan does), or plan the layer 'replicate'")
        return super().forward(x)


class ExpertColwise(Style):
    name = EXPERT_COLWISE
    description = "an expert's input projection inside a moe_block region: this rank's rows, no communication"
    column = True
    splits = True

    def check(self, name: str, m: nn.Module, role: Role | None, world: int) -> None:
        n = m.out_features if self.column else m.in_features
        if not _plain_linear(m) or n < world:
            raise PlanError(f"{name}: style {self.name!r} needs an nn.Linear with at least {world} "
                            f"{'output' if self.column else 'input'} features; use 'replicate'")
        if not self.column and m.bias is not None:
            raise PlanError(f"{name}: style {self.name!r} needs an output projection without a bias")

    def layouts(self, m: nn.Module, role: Role | None, world: int, rank: int) -> Layouts:
        out = {"weight": ShardLayout.split(tuple(m.weight.shape), 0 if self.column else 1, world, rank)}
        if m.bias is not None:
            out["bias"] = ShardLayout.split(tuple(m.bias.shape), 0, world, rank)
        return out

    def build(self, m: nn.Module, layouts: Layouts, comm, sequence_parallel: bool = False) -> nn.Module:
        w = layouts["weight"]
        n_out, n_in = w.local_shape
        new = RegionLinear(n_in, n_out, bias=m.bias is not None, device="meta")
        for pname, lay in layouts.items():
            p = getattr(m, pname)
            q = nn.Parameter(lay.shard(p.detach()).clone(), requires_grad=p.requires_grad)
            setattr(new, pname, q)
        return new.train(m.training)


class ExpertRowwise(ExpertColwise):
    name = EXPERT_ROWWISE
    description = ("an expert's output projection inside a moe_block region: this rank's columns, a partial sum "
                   "(the block all-reduces once)")
    column = False


class MoEBlock(Style):
    name = MOE_BLOCK
    description = ("a MoE block with separate experts as one region: replicated inputs in, one all-reduce of its "
                   "combined output; router whole, its gradient summed")
    collectives = ("all_reduce",)
    container = region = splits = True


ROUTER_REASON = "the router of a moe_block: whole, so every rank routes alike; its gradient is summed"


class ExpertBlocks(Family):
    """Every MoE block of separate experts that splits exactly as one region, over any entries the per-layer
    families made for its layers; the others keep those entries, with the reason noted on the router."""

    name = "expert_blocks"
    styles = (ExpertColwise(), ExpertRowwise(), MoEBlock())

    def detect(self, analysis) -> list[tuple[str, ExpertBlock | str, str | None]]:
        """Every block with a list of separate experts: (name, its layout or why it has none, why it is not one
        region: probed with real weights once, world-size free)."""
        out = []
        for name, block in analysis.model.named_modules():
            found = find_block(name, block)
            if found is not None:
                out.append((name, found, found if isinstance(found, str) else probe(block, found)))
        return out

    def propose(self, draft: Draft, found: list[tuple[str, ExpertBlock | str, str | None]]) -> Iterator[Proposal]:
        world = draft.world_size
        for name, block, why in found:
            if why is None and block.intermediate < world:
                why = f"{block.intermediate} intermediate features per expert cannot be split over {world} ranks"
            if why is not None:
                names = ([block.router] if not isinstance(block, str) else []) + ([name] if name else [])
                # (the root of a model that merely looks like a block, a ModuleList beside a small head, is noise)
                yield Proposal(self.name, name, (Choice("whole", reasons={
                    n: why for n in names if n not in draft.reasons}),))
                continue
            region = Choice("one region", {name: MOE_BLOCK, **{n: EXPERT_COLWISE for n in block.columns},
                                           **{n: EXPERT_ROWWISE for n in block.rows}, block.router: REPLICATE},
                            reasons={block.router: ROUTER_REASON})
            yield Proposal(self.name, name, (region, Choice("per layer")))

    def install(self, model: nn.Module, planned: Planned, checked: Checked | None, comm) -> None:
        if comm.world_size > 1:
            experts = [n for n, s in planned.styles.items() if s in (EXPERT_COLWISE, EXPERT_ROWWISE)]
            for name, s in planned.styles.items():
                if s == MOE_BLOCK:
                    inside = name + "." if name else ""
                    split = {n[len(inside):] for n in experts if n.startswith(inside)}
                    BlockRegion(comm).install(model.get_submodule(name) if name else model, split)
