"""Replicas that stay replicas: a run-time check that every tensor several ranks hold is the same on each of them.

The worst tensor-parallel bugs are silent: a replicated tensor whose copies drift apart. A gradient sum lost on
one path (KV rows two ranks share got different gradients, so their copies diverged after the first step), a
sequence-parallel norm whose partial gradients were never summed, an all-reduce dropped from a backward: each
leaves every rank computing something plausible, and nothing fails. tpkit knows from its `ShardLayout`s exactly
which bytes ranks must hold in common: whole replicated tensors, and the entries of a split tensor that several
ranks hold (KV rows spread over more ranks than heads). `check_replicas` compares them bit for bit.

How: each rank digests every such tensor (or piece) where it lives (on its device: the bytes read as integers,
their sum and sum of squares, wrapping), the ranks all-gather the digests (a few bytes per tensor), and only
where the digests differ are the values themselves gathered, to name the ranks that disagree and the largest
difference. `watch_replicas` runs it every `every` optimizer steps: gradients just before the step, parameters
just after (every step under TP_DEBUG=1).

Exact by default. Replicated work on the same inputs is bit-identical on the CPU and with deterministic kernels;
on CUDA, kernels that accumulate with atomics (an embedding's backward, `index_add_`) may differ by a few ulps
across ranks unless `torch.use_deterministic_algorithms(True)`. For such tensors pass `tolerance={glob: rel}`:
matching tensors whose digests differ are compared in full and pass when their largest difference, relative to
their largest magnitude, is within `rel` (the report counts them).

Slices overwritten: on a healthy model the ranks' slices of a split tensor differ; when every such tensor (each by
its first values, constant ones skipped: `tpkit.nn.sentinel.split_samples`) is the same on every tp rank, a broadcast
overwrote them (the constructor of a DistributedDataParallel or `fully_shard` around the model over its
tensor-parallel ranks) and the check says so. What it cannot see: the gradients of different slices averaged
together by a DDP that broadcast nothing (`init_sync=False`), which leaves the slices different.

Under `data_parallel`: DDP keeps a whole copy of every TP-local tensor on each data-parallel rank, so every
tensor is also compared across the data-parallel group. FSDP2 holds a different dim-0 shard on each data-parallel
rank; the tensor-parallel check then runs on those local shards (the shard of a TP-replicated tensor is the same
on every TP rank of one data-parallel index), and pieces split along dim 0 by tensor parallelism are skipped.

Under `context_parallel`: the cp ranks of a replica hold the same tensors (the same FSDP2 shard of them), and every
tensor is compared across the cp group too.

Under `expert_parallel`: each expert's weights are held by the ranks of the expert-data group only (one per expert
group), so they are compared there and nowhere else.

Under `tpkit.pipeline`: each stage's tp and dp groups are checked as above, a weight tied across the first and the
last stage (each holds a copy) is compared over its group of two (or on the one rank holding both stages), and a
divergence any stage finds is raised on every rank (the pipeline group joins the flag's sum).
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Mapping

import torch
from torch import nn

from .comm.communicator import Communicator
from .comm.debug import debug_enabled
from .convert.layouts import shard_layouts
from .layout import ShardLayout
from .nn.digests import digest
from .nn.sentinel import split_samples
from .nn.record import communicator_of, find_record

class ReplicaError(RuntimeError):
    """Copies of a tensor that several ranks hold differ: a silent tensor-parallel bug made visible."""


@dataclasses.dataclass(frozen=True)
class Divergence:
    """One tensor (or piece) whose copies differ: its state-dict key, "param" or "grad", the ranks grouped by
    the bytes they hold (each group agrees), and the largest absolute and relative difference."""

    key: str
    what: str
    rows: tuple[int, ...] | None
    groups: tuple[tuple[int, ...], ...]
    max_abs: float
    max_rel: float
    group_name: str = "tp"
    note: str = ""  # what the copies show instead of a difference

    def describe(self) -> str:
        where = f"{self.key} ({self.what}{f', rows {list(self.rows)}' if self.rows else ''})"
        if self.note:
            return f"{where}: {self.note}"
        if any(not g for g in self.groups):
            return f"{where}: missing on some {self.group_name} ranks"
        split = " vs ".join(f"{self.group_name} rank{'s' if len(g) > 1 else ''} {list(g)}" for g in self.groups)
        return f"{where}: {split}; largest difference {self.max_abs:.3g} (relative {self.max_rel:.3g})"


@dataclasses.dataclass(frozen=True)
class ReplicaReport:
    """What one check compared: `tensors` (tensors or pieces, params and grads counted apart), `bytes` of them on
    this rank, `tolerated` (differed within the caller's tolerance), `skipped` (pieces FSDP2 shards away)."""

    tensors: int
    bytes: int
    tolerated: tuple[Divergence, ...] = ()
    skipped: int = 0

    def summary(self) -> str:
        out = f"replicas: {self.tensors} tensors ({self.bytes / 2**20:.2f} MiB on this rank) agree"
        if self.tolerated:
            out += f"; {len(self.tolerated)} within tolerance: " + "; ".join(d.describe() for d in self.tolerated)
        if self.skipped:
            out += f"; {self.skipped} pieces sharded by FSDP2 not compared"
        return out


@dataclasses.dataclass(frozen=True)
class _Item:
    """A tensor or piece some ranks of a group hold in common: `holders` (group ranks), `dim` and per-holder
    local positions along it (`local`, None: the whole tensor), `rows` (positions in the full tensor)."""

    key: str
    holders: tuple[int, ...]
    dim: int | None = None
    local: tuple[tuple[int, ...], ...] | None = None
    rows: tuple[int, ...] | None = None


def _shared_items(key: str, lay: ShardLayout, sharded: bool) -> list[_Item]:
    """The pieces of `key` several ranks of its tensor-parallel group hold."""
    world = lay.world_size
    if lay.is_replicated:
        return [_Item(key, tuple(range(world)))]
    if sharded or not lay.shares_entries():
        return []
    index = [lay.for_rank(r).index() for r in range(world)]
    holders: dict[int, list[int]] = {}
    for r, idx in enumerate(index):
        for i in idx:
            holders.setdefault(i, []).append(r)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in sorted(holders):
        if len(holders[i]) > 1:
            groups.setdefault(tuple(holders[i]), []).append(i)
    dim = 1 - lay.dim if lay.transposed else lay.dim
    return [_Item(key, hs, dim, tuple(tuple(index[r].index(i) for i in rows) for r in hs), tuple(rows))
            for hs, rows in groups.items()]


def _piece(t: torch.Tensor, item: _Item, rank: int) -> torch.Tensor:
    if item.local is None:
        return t
    at = item.holders.index(rank)
    return t.index_select(item.dim, torch.tensor(item.local[at], device=t.device))


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """An FSDP2 parameter's (or gradient's) local shard; any other tensor as it is."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def _tolerance(key: str, tolerance: Mapping[str, float] | None) -> float | None:
    for pattern, rel in (tolerance or {}).items():
        if fnmatch.fnmatchcase(key, pattern):
            return float(rel)
    return None


def _compare(tensors: dict[str, torch.Tensor | None], items: list[_Item],
             comm: Communicator) -> tuple[list[tuple[_Item, list[list[int]]]], int]:
    """Digest every item this rank holds, all-gather the digests over `comm`, and return the items whose
    holders disagree (with the holders grouped by digest) and the bytes digested here."""
    if not items:
        return [], 0
    rank, digests, nbytes, device = comm.rank, [], 0, _device(tensors)
    for item in items:
        t = tensors.get(item.key) if rank in item.holders else None
        piece = None if t is None else _piece(t, item, rank)
        nbytes += 0 if piece is None else piece.numel() * piece.element_size()
        digests.append(digest(piece, device))
    table = comm.all_gather(torch.stack(digests).unsqueeze(0), dim=0).cpu()  # the one host sync
    diverged = []
    for n, item in enumerate(items):
        classes: dict[tuple[int, ...], list[int]] = {}
        for r in item.holders:
            classes.setdefault(tuple(table[r, n].tolist()), []).append(r)
        if len(classes) > 1:
            diverged.append((item, list(classes.values())))
    return diverged, nbytes


def _device(tensors: dict[str, torch.Tensor | None]) -> torch.device:
    first = next((t for t in tensors.values() if t is not None), None)
    return torch.device("cpu") if first is None or first.device.type == "cpu" else first.device


def _measure(tensors: dict[str, torch.Tensor | None], like: torch.Tensor, item: _Item, groups: list[list[int]],
             comm: Communicator, what: str, group_name: str) -> Divergence:
    """The values of a diverged item, gathered (collective: every rank of `comm` calls it for the same items),
    and its largest difference from the lowest holder's copy. `like`: the local parameter (shape, device)."""
    t = tensors.get(item.key)
    held = t is not None and comm.rank in item.holders
    shape = list(like.shape)
    if item.local is not None:
        shape[item.dim] = len(item.rows)
    mine = _piece(t, item, comm.rank) if held else torch.zeros(shape, dtype=like.dtype, device=like.device)
    flags = comm.all_gather(torch.tensor([float(held)], dtype=torch.float64, device=like.device), dim=0).cpu()
    values = comm.all_gather(mine.detach().to(torch.float64).unsqueeze(0).contiguous(), dim=0)
    holders = [r for r in item.holders if flags[r] > 0]
    if len(holders) < len(item.holders):
        return Divergence(item.key, what, item.rows, (tuple(holders), ()), float("inf"), float("inf"), group_name)
    ref = values[holders[0]]
    diff = max((values[r] - ref).abs().max().item() for r in holders)
    scale = max(values[r].abs().max().item() for r in holders)
    return Divergence(item.key, what, item.rows, tuple(tuple(g) for g in groups), diff,
                      diff / scale if scale > 0 else float("inf"), group_name)


def _check_group(tensors: dict[str, torch.Tensor | None], params: dict[str, torch.Tensor], items: list[_Item],
                 comm: Communicator, what: str, group_name: str,
                 tolerance: Mapping[str, float] | None) -> tuple[int, list[Divergence], list[Divergence]]:
    diverged, nbytes = _compare(tensors, items, comm)
    bad, tolerated = [], []
    for item, groups in diverged:
        d = _measure(tensors, params[item.key], item, groups, comm, what, group_name)
        rel = _tolerance(item.key, tolerance)
        (tolerated if rel is not None and d.max_rel <= rel else bad).append(d)
    return nbytes, bad, tolerated


def check_replicas(model: nn.Module, comm: Communicator | None = None, grads: bool = True, params: bool = True,
                   tolerance: Mapping[str, float] | None = None) -> ReplicaReport:
    """Compare, bit for bit, every tensor or piece several ranks hold: parameters (`params`) and their `.grad`
    (`grads`). Collective over the model's tensor-parallel group (`comm`, default the communicator of its tpkit
    layers), and over the data-parallel group too under DDP. Raises `ReplicaError` naming each tensor that
    differs (state-dict key, param or grad, the ranks grouped by what they hold, the largest difference);
    returns a `ReplicaReport` otherwise. `tolerance`: `{glob of keys: relative difference allowed}` for tensors
    computed by nondeterministic kernels (see the module docstring)."""
    found = find_record(model, "check_replicas")
    record = found[1].data_parallel if found is not None else None
    pipe = found[1].pipeline if found is not None else None
    context = found[1].context if found is not None else None
    cp = context.comm if context is not None and context.comm.world_size > 1 else None
    inner = record.module if record is not None else model
    if record is not None:
        record.reshard()
    tp = comm if comm is not None else record.tp_comm if record is not None else communicator_of(inner)
    sharded = record is not None and record.mode == "fsdp"
    layouts = record.layouts if record is not None else shard_layouts(inner)
    experts = found[1].experts if found is not None else None
    expert_keys = experts.keys if experts is not None else frozenset()
    named = dict(inner.named_parameters())
    local = {k: _local(p) for k, p in named.items()}
    layouts = {k: v for k, v in layouts.items() if k not in expert_keys}
    kinds = [("param", local)] if params else []
    kinds += [("grad", {k: _local(p.grad) for k, p in named.items()})] if grads else []
    groups: list[tuple[Communicator, list[_Item], str]] = []
    skipped = 0
    if tp is not None and tp.world_size > 1:
        items = []
        for k in named:
            lay = layouts.get(k)  # (an expert weight has none here: its copies are the edp group's, below)
            if lay is not None and lay.world_size == tp.world_size:
                found = _shared_items(k, lay, sharded)
                skipped += int(sharded and not found and lay.shares_entries())
                items += found
        groups.append((tp, items, "tp"))
    if record is not None and record.mode == "ddp" and record.dp_size > 1:
        groups.append((record.dp_comm, [_Item(k, tuple(range(record.dp_size))) for k in named
                                        if k not in expert_keys], "dp"))
    if cp is not None:  # the cp ranks of one replica hold the same tensors (or the same FSDP2 shard of them)
        groups.append((cp, [_Item(k, tuple(range(cp.world_size))) for k in named if k not in expert_keys], "cp"))
    if experts is not None and experts.edp is not None and not experts.fsdp:  # the ranks holding the same experts
        groups.append((experts.edp, [_Item(k, tuple(range(experts.edp.world_size))) for k in sorted(expert_keys)],
                       "edp"))
    tied = getattr(pipe, "tied", None)
    if tied is not None and tied.comm is not None:  # this rank's copy of each tied pair, the other stage's rank
        groups.append((tied.comm, [_Item(k, (0, 1)) for k in tied.keys], "tied"))
    count, nbytes, bad, tolerated = 0, 0, [], []
    for what, tensors in kinds:
        for group, items, name in groups:
            n, b, t = _check_group(tensors, local, items, group, what, name, tolerance)
            count, nbytes = count + len(items), nbytes + n
            bad += b
            tolerated += t
        if tied is not None and tied.comm is None:
            count, bad = count + len(tied.pairs), bad + _tied_here(tensors, tied.pairs, what)
    if params and tp is not None and tp.world_size > 1:  # on every rank alike: a collective of the tp group
        bad += _overwritten(local, layouts, tp)
    spread = [g for g in (tp, cp, record.dp_comm if record is not None else None, getattr(pipe, "pp_comm", None),
                          experts.ep if experts is not None else None) if g is not None and g.world_size > 1]
    elsewhere = _found_elsewhere(bool(bad), spread, _device(local))
    if elsewhere and not bad:
        raise ReplicaError(f"{elsewhere} other rank(s) of this model found copies that differ (their ReplicaError "
                           f"names the tensors); this rank's copies agree with its groups'")
    if bad:
        raise ReplicaError(f"{len(bad)} tensor(s) that several ranks hold differ across them (a silent tensor-"
                           f"parallel bug: a lost gradient sum, a skipped all-reduce, a rank-local update): "
                           + "; ".join(d.describe() for d in bad[:8]) + (" ..." if len(bad) > 8 else ""))
    return ReplicaReport(count, nbytes, tuple(tolerated), skipped * len(kinds))


def _overwritten(local: dict[str, torch.Tensor | None], layouts: Mapping[str, ShardLayout],
                 tp: Communicator) -> list[Divergence]:
    """One `Divergence` when every tensor the tp ranks hold disjoint slices of is identical across them (a broadcast
    overwrote the slices: DDP or fully_shard over the tensor-parallel ranks), else none."""
    named = [(k, t) for k, t in local.items() if t is not None and k in layouts and
             layouts[k].world_size == tp.world_size]
    samples = split_samples(named, lambda k, shape: layouts[k])
    everyone = tuple(range(tp.world_size))
    diverged, _ = _compare(dict(samples), [_Item(k, everyone) for k, _ in samples], tp)
    if diverged or all(t is None for _, t in samples):  # (the same on every rank when nothing diverged)
        return []
    return [Divergence(samples[0][0], "param", None, (everyone,), 0.0, 0.0, note=(
        f"this and every other split tensor ({len(samples)}) holds the same values on every tp rank: the slices were "
        f"overwritten by a broadcast (DistributedDataParallel or fully_shard around the model over its "
        f"tensor-parallel ranks; use tpkit.data_parallel over the data-parallel group only)"))]


def _tied_here(tensors: dict[str, torch.Tensor | None], pairs, what: str) -> list[Divergence]:
    """The tied pairs whose two copies (both stages on this rank) differ."""
    out = []
    for pair in pairs:
        a, b = tensors.get(pair.first), tensors.get(pair.last)
        if a is not None and b is not None and not torch.equal(a, b):  # the same update of the same values
            diff = (a.double() - b.double()).abs().max().item()
            scale = a.double().abs().max().item()
            out.append(Divergence(f"{pair.first} / {pair.last}", what, None, ((0,), (1,)), diff,
                                  diff / scale if scale > 0 else float("inf"), "tied copy"))
    return out


def _found_elsewhere(mine: bool, groups: list[Communicator], device: torch.device) -> int:
    """How many other ranks of the whole model found a divergence: the flag summed over the tp group, then over
    the dp group (one member of every tp group), then over the pipeline group (one member of every stage), so every
    rank learns of one any group found and all raise together. On the tensors' device (NCCL takes no CPU
    tensors)."""
    total = torch.tensor([float(mine)], dtype=torch.float64, device=device)
    for g in groups:
        total = g.all_reduce(total)
    return int(total.item()) - int(mine)


class ReplicaWatch:
    """The hooks `watch_replicas` put on an optimizer; `remove()` takes them off. `checks` counts the checks run,
    `last` is the last report."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, every: int, comm: Communicator | None,
                 tolerance: Mapping[str, float] | None):
        self.model, self.optimizer, self.every, self.comm, self.tolerance = model, optimizer, every, comm, tolerance
        self.steps, self.checks, self.last = 0, 0, None
        self._handles = [optimizer.register_step_pre_hook(self._before),
                         optimizer.register_step_post_hook(self._after)]

    def due(self) -> bool:
        """Whether the step about to run (or just run) is one to check: every `every`-th, or each under TP_DEBUG."""
        return debug_enabled() or (self.steps + 1) % self.every == 0

    def _before(self, optimizer, args, kwargs) -> None:
        if self.due():
            self.last = check_replicas(self.model, self.comm, grads=True, params=False, tolerance=self.tolerance)
            self.checks += 1

    def _after(self, optimizer, args, kwargs) -> None:
        try:
            if self.due():
                self.last = check_replicas(self.model, self.comm, grads=False, params=True, tolerance=self.tolerance)
                self.checks += 1
        finally:
            self.steps += 1

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def watch_replicas(model: nn.Module, optimizer: torch.optim.Optimizer, every: int = 50,
                   comm: Communicator | None = None, tolerance: Mapping[str, float] | None = None) -> ReplicaWatch:
    """Check the replicas of `model` every `every` optimizer steps (every step under TP_DEBUG=1): gradients just
    before the step, parameters just after; a divergence raises `ReplicaError` from `optimizer.step()`. Returns
    a handle whose `remove()` stops it. Every rank must step the same optimizer the same number of times."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"watch_replicas: every must be a positive int (optimizer steps between checks), got "
                         f"{every!r}")
    return ReplicaWatch(model, optimizer, every, comm, tolerance)

