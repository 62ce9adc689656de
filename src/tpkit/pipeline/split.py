"""Where to cut a model into pipeline stages: between its repeated blocks, balanced by cost and memory.

The blocks: the `nn.ModuleList` a Hugging Face class names in its `base_model_pp_plan` (Llama's
`{"embed_tokens": ..., "layers": ..., "norm": ...}`), else the list holding the model's repeated blocks
(`tpkit.data_parallel.repeated_blocks`: HF's `_no_split_modules` classes, else the longest `nn.ModuleList`). Every
other module that holds parameters or persistent buffers belongs to the first stage when it comes before the
blocks in the model's registration order (the embeddings) and to the last stage when it comes after (the final
norm, the LM head); modules with neither (a rotary embedding's computed tables) are kept on every stage.

Each stage is a contiguous run of blocks, the first stage's with the modules before, the last stage's with those
after. The automatic split balances the stages' loads, a load being the larger of a stage's share of the model's
FLOPs and its share of the parameter bytes (`block_costs`): FLOPs per token are 2 x the parameters of every
non-embedding weight of two or more dims (a matmul's multiply-adds; an embedding is a lookup and costs none;
attention's sequence-length term is left out: the same in every block), bytes are the parameters the stage holds
(a weight tied across the first and last stage counts on both: each holds a copy). The cut minimising the largest
load is found exactly (dynamic programming over the cut points). `starts=[0, 3, 5]` overrides it: the first block
of each stage.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from torch import nn

from ..data_parallel import repeated_blocks


class SplitError(ValueError):
    """A model that cannot be cut into the stages asked for (no repeated blocks, fewer blocks than stages, a bad
    `starts`), raised before anything changes."""


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """How a model is cut: the block list's module name, the first block of each stage, and the modules outside
    the blocks that the first and the last stage hold. `loads`: each stage's load (see the module docstring)."""

    blocks: str
    num_blocks: int
    starts: tuple[int, ...]
    first: tuple[str, ...]
    last: tuple[str, ...]
    loads: tuple[float, ...] = ()
    stage_bytes: tuple[float, ...] = ()  # parameter bytes each stage holds (a tied weight on both ends)

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def stage_blocks(self, stage: int) -> range:
        """The block indices stage `stage` holds."""
        end = self.starts[stage + 1] if stage + 1 < len(self.starts) else self.num_blocks
        return range(self.starts[stage], end)

    def stage_of_block(self, i: int) -> int:
        return max(s for s, start in enumerate(self.starts) if start <= i)

    def owner(self, name: str) -> int | None:
        """The stage holding module `name` (a block, a block's submodule, or a first / last module), or None for a
        module every stage keeps."""
        prefix = self.blocks + "."
        if name.startswith(prefix):
            return self.stage_of_block(int(name[len(prefix):].split(".")[0]))
        if any(name == m or name.startswith(m + ".") for m in self.first):
            return 0
        if any(name == m or name.startswith(m + ".") for m in self.last):
            return self.num_stages - 1
        return None

    def describe(self) -> str:
        """One line per stage: its blocks, its extra modules, its load and its parameter bytes."""
        out = []
        for s in range(self.num_stages):
            r = self.stage_blocks(s)
            extra = (list(self.first) if s == 0 else []) + (list(self.last) if s == self.num_stages - 1 else [])
            load = f", load {self.loads[s]:.2f}" if self.loads else ""
            held = f", {self.stage_bytes[s] / 2**20:.1f} MiB of parameters" if self.stage_bytes else ""
            out.append(f"stage {s}: {self.blocks}.{r.start}..{r.stop - 1}"
                       f"{' + ' + ', '.join(extra) if extra else ''}{load}{held}")
        return "\n".join(out)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """`(name, list)` of the model's repeated blocks (see the module docstring); SplitError naming why there are
    none."""
    named = {m: n for n, m in model.named_modules()}
    lists = [named[m] for m in _pp_plan_lists(model) if m in named]
    if lists:
        name = lists[0]
        return name, model.get_submodule(name)
    found = repeated_blocks(model)
    parents = {n.rpartition(".")[0] for m in found for n in [named.get(m, "")]}
    if not found or len(parents) != 1:
        raise SplitError(f"cannot cut {type(model).__name__} into pipeline stages: "
                         + ("it has no repeated blocks (no base_model_pp_plan, no _no_split_modules class, no "
                            "nn.ModuleList of blocks)" if not found else
                            f"its repeated blocks are in several lists ({sorted(parents)})")
                         + "; pipeline parallelism cuts between the blocks of one list")
    name = parents.pop()
    lst = model.get_submodule(name)
    if not isinstance(lst, nn.ModuleList) or len(lst) != len(found):
        raise SplitError(f"cannot cut {type(model).__name__} into pipeline stages: its repeated blocks are not the "
                         f"whole of one nn.ModuleList ({name})")
    return name, lst


def _pp_plan_lists(model: nn.Module) -> list[nn.Module]:
    """The nn.ModuleLists HF's `base_model_pp_plan` names (on the base model), in the plan's order."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None) or {}
    base = getattr(model, getattr(model, "base_model_prefix", "") or "", None)
    base = base if isinstance(base, nn.Module) else model
    out = []
    for key in plan:
        try:
            m = base.get_submodule(key)
        except AttributeError:
            continue
        if isinstance(m, nn.ModuleList):
            out.append(m)
    return out


def outside_modules(model: nn.Module, blocks: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`(first, last)`: the outermost modules outside the blocks that hold parameters or persistent buffers, before
    and after the block list in registration order."""
    names = [n for n, _ in model.named_modules()]
    at = names.index(blocks)
    first, last = [], []
    for i, (name, m) in enumerate(model.named_modules()):
        if not name or name == blocks or name.startswith(blocks + ".") or blocks.startswith(name + "."):
            continue
        if any(name.startswith(o + ".") for o in first + last) or not _holds_state(m):
            continue
        (first if i < at else last).append(name)
    return tuple(first), tuple(last)


def _holds_state(m: nn.Module) -> bool:
    return any(True for _ in m.parameters()) or any(
        name not in sub._non_persistent_buffers_set for sub in m.modules() for name, b in sub._buffers.items()
        if b is not None)


def module_cost(m: nn.Module) -> tuple[float, float]:
    """`(FLOPs per token of the forward, parameter bytes)` of a module (see the module docstring)."""
    flops, nbytes, seen = 0.0, 0.0, set()
    for sub in m.modules():
        for p in sub.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            nbytes += p.numel() * p.element_size()
            if p.dim() >= 2 and not isinstance(sub, nn.Embedding):
                flops += 2.0 * p.numel()
    return flops, nbytes


def block_costs(model: nn.Module, blocks: str, first: Sequence[str], last: Sequence[str]):
    """`(per-block costs, first modules' cost, last modules' cost)`, each `(flops, bytes)`."""
    lst = model.get_submodule(blocks)
    per_block = [module_cost(b) for b in lst]
    def add(names: Sequence[str]) -> tuple[float, float]:
        costs = [module_cost(model.get_submodule(n)) for n in names]
        return sum(c[0] for c in costs), sum(c[1] for c in costs)
    return per_block, add(first), add(last)


def stage_load(per_block: Sequence[tuple[float, float]], head: tuple[float, float], tail: tuple[float, float]):
    """`load(i, j)`: the load of blocks i..j-1 as one stage (with the first modules when i is 0, the last when j is
    the end): the larger of its share of the FLOPs and its share of the bytes."""
    n = len(per_block)
    totals = [sum(c[k] for c in per_block) + head[k] + tail[k] or 1.0 for k in (0, 1)]
    prefix = [[0.0], [0.0]]
    for c in per_block:
        for k in (0, 1):
            prefix[k].append(prefix[k][-1] + c[k])

    def load(i: int, j: int) -> float:
        cost = [prefix[k][j] - prefix[k][i] + (head[k] if i == 0 else 0.0) + (tail[k] if j == n else 0.0)
                for k in (0, 1)]
        return max(cost[0] / totals[0], cost[1] / totals[1])

    return load


def balance(per_block: Sequence[tuple[float, float]], head: tuple[float, float], tail: tuple[float, float],
            stages: int) -> tuple[int, ...]:
    """The first block of each of `stages` contiguous stages minimising the largest load."""
    n, load = len(per_block), stage_load(per_block, head, tail)

    @functools.lru_cache(maxsize=None)
    def best(i: int, k: int) -> tuple[float, tuple[int, ...]]:  # blocks i.. cut into k stages
        if k == 1:
            return load(i, n), (i,)
        return min((max(load(i, j), best(j, k - 1)[0]), (i,) + best(j, k - 1)[1]) for j in range(i + 1, n - k + 2))

    return best(0, stages)[1]


def split_stages(model: nn.Module, stages: int, starts: Sequence[int] | None = None) -> StageSplit:
    """Where to cut `model` into `stages` pipeline stages (see the module docstring): balanced automatically, or at
    `starts` (the first block of each stage). Changes nothing; SplitError naming the reason when it cannot."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise SplitError(f"split_stages: stages must be a positive int, got {stages!r}")
    name, lst = find_blocks(model)
    n = len(lst)
    if stages > n:
        raise SplitError(f"cannot cut {type(model).__name__} into {stages} pipeline stages: it has {n} blocks "
                         f"({name}) and each stage needs at least one; use at most {n} stages (pp x stages per rank)")
    first, last = outside_modules(model, name)
    per_block, head, tail = block_costs(model, name, first, last)
    auto = balance(per_block, head, tail, stages)
    if starts is not None:
        starts = tuple(int(s) for s in starts)
        if len(starts) != stages or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) \
                or starts[-1] >= n:
            raise SplitError(f"split_stages: starts={list(starts)} must be {stages} increasing block indices, the "
                             f"first 0 and the last below {n} (the blocks of {name}); e.g. {list(auto)}")
    chosen = starts if starts is not None else auto
    load = stage_load(per_block, head, tail)
    ends = chosen[1:] + (n,)
    loads = tuple(load(a, b) for a, b in zip(chosen, ends))
    held = tuple(sum(per_block[i][1] for i in range(a, b)) + (head[1] if a == 0 else 0.0) + (tail[1] if b == n else 0.0)
                 for a, b in zip(chosen, ends))
    return StageSplit(name, n, chosen, first, last, loads, held)
