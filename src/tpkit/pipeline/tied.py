"""Weights tied across the first and the last stage (an input embedding shared with the LM head): Megatron's
embedding group.

In one process the two modules hold one Parameter, and its gradient is the sum of both uses. Cut into stages on
different ranks, each of the two stages holds its own copy (the first under the embedding's key, the last under
the head's), equal at the start; after every backward the two gradients are summed over the two ranks (one
all-reduce per (dp, cp, tp) position on a group of two), so both copies take the same step and stay one tensor. The
norm counts the tensor once (the last stage's copy is left out of it), a checkpoint holds it once (the last
stage's key is saved as an alias of the first's, as a tied model's state dict is), and the replica sentinel
compares the two copies. On one rank (a V-shaped schedule puts the first and last stage together) the two stages
hold two copies all the same (torch's schedules compute each stage's weight gradients apart), summed locally.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..comm.communicator import Communicator
from .layout import world_rank
from .split import SplitError, StageSplit


@dataclasses.dataclass(frozen=True)
class TiedPair:
    """One tensor the first stage holds under `first` and the last stage under `last` (state-dict keys)."""

    first: str
    last: str


def tied_pairs(model: nn.Module, split: StageSplit) -> list[TiedPair]:
    """The parameters of `model` shared between the first and the last stage; SplitError for a parameter shared
    between other stages (pipeline parallelism carries only the first / last stage tie)."""
    keys: dict[int, list[str]] = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        keys.setdefault(id(p), []).append(key)
    out = []
    for names in keys.values():
        owners = {split.owner(k.rpartition(".")[0]) for k in names}
        if len(owners) < 2:
            continue
        if owners != {0, split.num_stages - 1}:
            raise SplitError(f"{names} are one parameter used by stages {sorted(owners, key=str)}; pipeline "
                             f"parallelism carries a weight tied across the first and the last stage only (an "
                             f"embedding and its LM head): choose a split that keeps the others in one stage")
        first = next(k for k in names if split.owner(k.rpartition(".")[0]) == 0)
        last = next(k for k in names if split.owner(k.rpartition(".")[0]) == split.num_stages - 1)
        out.append(TiedPair(first, last))
    return out


def untie(model: nn.Module, pairs: list[TiedPair]) -> None:
    """Give the last stage's side of each pair its own copy of the tensor (both stages on one rank)."""
    for pair in pairs:
        owner, _, leaf = pair.last.rpartition(".")
        module = model.get_submodule(owner)
        p = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)


@dataclasses.dataclass(eq=False)
class TiedCopies:
    """This rank's side of the tied pairs: `role` "first", "last" or "both" (the two stages on this rank), and the
    group of two ranks holding the two copies (this rank's dp and tp position on the first and last stage; None
    for "both")."""

    pairs: tuple[TiedPair, ...]
    role: str
    comm: Communicator | None

    @property
    def keys(self) -> list[str]:
        """This rank's keys of the pairs (for "both": every first key, then every last key)."""
        return [p.first for p in self.pairs if self.role != "last"] + \
            [p.last for p in self.pairs if self.role != "first"]

    @property
    def aliases(self) -> dict[str, str]:
        """`{key: key it copies}` of the copies held apart on the last stage (saved as aliases, out of the norm)."""
        return {p.last: p.first for p in self.pairs} if self.role != "first" else {}

    def own_memory(self, part: nn.Module) -> None:
        """Give the last stage's copies memory of their own when both stages are on this rank (a load that maps the
        checkpoint's bytes gives two tensors read from one stored tensor one memory)."""
        if self.role != "both":
            return
        untie(part, list(self.pairs))

    @torch.no_grad()
    def sum_gradients(self, part: nn.Module) -> None:
        """Sum each pair's two gradients (over the two ranks: FSDP2's local shards, both ranks holding the same one;
        or here, for "both")."""
        params = dict(part.named_parameters(remove_duplicate=False))
        grads = {}
        for key in self.keys:
            grad = params[key].grad
            if grad is None:
                raise RuntimeError(f"pipeline: the tied weight {key} has no gradient after the backward; the step "
                                   f"must run a backward on every stage before its tied gradients are summed")
            grads[key] = grad.to_local() if hasattr(grad, "to_local") else grad
        for pair in self.pairs:
            if self.role == "both":
                total = grads[pair.first] + grads[pair.last]
                grads[pair.first].copy_(total)
                grads[pair.last].copy_(total)
            else:
                local = grads[pair.first if self.role == "first" else pair.last]
                local.copy_(self.comm.all_reduce(local))


def tied_groups(world: Communicator, pairs: list[TiedPair], first_rank: int, last_rank: int, my_pp_rank: int,
                dp: int, tp: int, cp: int = 1) -> Communicator | None:
    """The two-rank groups of the tied copies (one per dp x cp x tp position, pipeline ranks `first_rank` and
    `last_rank`); this rank's, or None when it holds neither side. Collective over the world: every rank creates
    every group, in the same order (none when there is no pair, or both sides are on one pipeline rank)."""
    if not pairs or first_rank == last_rank:
        return None
    mine = None
    for d in range(dp):
        for c in range(cp):
            for t in range(tp):
                ends = [world_rank(p, d, t, dp, tp, c, cp) for p in (first_rank, last_rank)]
                group = world.new_group(ends)
                mine = group if group is not None else mine
    return mine if my_pp_rank in (first_rank, last_rank) else None
