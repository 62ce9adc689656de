"""The forward sentinel: a converted model notices, at its own forward, the misuse that would train it silently wrong.

A tensor-parallel model handed to a tool written for one process (transformers' `Trainer`, accelerate's `prepare`,
a hand-made `DistributedDataParallel`, torch's `clip_grad_norm_`) runs to the end and trains the wrong model: each
rank computes something plausible. What each of those does leaves a trace tpkit can see from inside the model, so
the model checks, at its first forward and every `every`-th training forward after it (`TPKIT_SENTINEL_EVERY`,
default 50; every forward under TP_DEBUG=1; `TPKIT_SENTINEL=0` turns it off):

1. every tensor argument of the forward is the same on every rank of the tensor-parallel group (a loader sharded
   over the whole world, as Trainer, accelerate and a world-wide `DistributedSampler` shard it, feeds the ranks
   different rows);
2. the tensors split over the group are not all identical across it (a broadcast overwrote them: DDP's
   constructor, or `fully_shard`, over the model's own tensor-parallel ranks);
3. the tensors every rank holds whole are identical across it (drift: gradients clipped with each rank's local
   norm, an update one rank made alone);
4. parameters are DTensors only under `tpkit.data_parallel` (`fully_shard` by hand shards the ranks' different
   slices as if they were one tensor).

`DistributedDataParallel` is refused earlier still, by its constructor: DDP reads the names of parameters to leave
alone from the module (`_ddp_params_and_buffers_to_ignore`, torch's own extension point); on a converted model that
attribute is a `RefuseDDP`, which raises when DDP reads it, before DDP broadcasts anything. `tpkit.data_parallel`
builds its DDP over the data-parallel group inside `allowing_ddp()`, where it reads as empty.

How: each rank digests those tensors (`digests.py`; a split tensor by its first 4096 values, a constant one is
skipped) and the group all-gathers the digests, one small collective, so every rank sees the same table and all
raise the same `SentinelError` together. A check is a host sync, so it runs eagerly only: inside `torch.compile`,
under a fake or recording dispatch mode, or on meta tensors the forward goes through unchecked (run
`tpkit.check_replicas` there). It is a forward pre-hook on the converted model, kept in its `_forward_pre_hooks`:
it follows the model through `deepcopy` and pickling, and refers to the model's record, not to the model.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..comm.debug import debug_enabled
from .digests import digest
from .record import ModelRecord

_ALLOWED = threading.local()
SAMPLE = 4096  # values of a split tensor digested to see whether it was overwritten
EVERY = 50


class SentinelError(RuntimeError):
    """A converted model was used in a way that trains or runs it silently wrong (see `tpkit.nn.sentinel`)."""


def every() -> int:
    """Training forwards between checks (`TPKIT_SENTINEL_EVERY`); 0 when the sentinel is off (`TPKIT_SENTINEL=0`)."""
    if os.environ.get("TPKIT_SENTINEL", "1") == "0":
        return 0
    return max(int(os.environ.get("TPKIT_SENTINEL_EVERY", EVERY)), 1)


class Sentinel:
    """The forward pre-hook (`install`); `checks` counts the checks run."""

    def __init__(self, record: ModelRecord):
        self.record, self.forwards, self.checks = record, 0, 0

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        n = every()
        if not n or self.record.world_size == 1 or self.record.pipeline is not None or not_eager():
            return
        training = module.training and torch.is_grad_enabled()
        due = self.checks == 0 or debug_enabled() or (training and (self.forwards + 1) % n == 0)
        self.forwards += int(training)
        if due and not _meta(module, args, kwargs):
            self.checks += 1
            check(module, self.record, args, kwargs)


def install(model: nn.Module, record: ModelRecord) -> Sentinel:
    """Put the sentinel on a converted `model` (its record: `record`), and refuse DDP wrapped around it by hand."""
    sentinel = Sentinel(record)
    model.register_forward_pre_hook(sentinel, with_kwargs=True)
    model._ddp_params_and_buffers_to_ignore = RefuseDDP()
    return sentinel


class RefuseDDP:
    """The parameters `DistributedDataParallel` should ignore, as DDP's constructor reads them from a converted model:
    none inside `allowing_ddp()` (`tpkit.data_parallel`), a `SentinelError` anywhere else."""

    def __iter__(self):
        if getattr(_ALLOWED, "depth", 0):
            return iter(())
        raise SentinelError(
            "tpkit: DistributedDataParallel wrapped around a tensor-parallel model would broadcast rank 0's slices "
            "over its group, overwriting the other ranks' (different) slices, and average gradients of different "
            "slices. transformers' Trainer and accelerate's prepare wrap the model this way: use "
            "tpkit.trainer.Trainer (tpkit.trainer.SFTTrainer for TRL). In your own loop, use "
            "tpkit.data_parallel(model, dp_comm, mode='ddp') over the data-parallel group only (tp, dp = "
            "tpkit.comm.split(world, tp_size))")


@contextlib.contextmanager
def allowing_ddp() -> Iterator[None]:
    """DDP may be built around converted models on this thread (tpkit.data_parallel, over the dp group)."""
    _ALLOWED.depth = getattr(_ALLOWED, "depth", 0) + 1
    try:
        yield
    finally:
        _ALLOWED.depth -= 1


def check(model: nn.Module, record: ModelRecord, args: tuple = (), kwargs: dict | None = None) -> None:
    """The four checks of the module docstring, now (collective over the record's tensor-parallel group)."""
    comm = record.comm
    _refuse_foreign_dtensors(model, record)
    inputs = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
    named = [(k, _local(p)) for k, p in model.named_parameters()]
    replicated = [(k, p) for k, p in named if (lay := record.known_layout(k, p.shape)) is None or lay.is_replicated]
    split = split_samples(named, record.known_layout)
    device = next((p.device for _, p in named), torch.device("cpu"))
    rows = [digest(t.to(device) if t.device != device else t, device) for t in inputs]
    rows += [digest(p, device) for _, p in replicated] + [digest(s, device) for _, s in split]  # None: zeros
    if not rows:
        return
    mine = torch.stack(rows).unsqueeze(0)
    counts = comm.all_gather(torch.tensor([[len(inputs), len(replicated), len(split)]], device=device), dim=0).cpu()
    if not bool((counts == counts[0]).all()):
        raise SentinelError(f"tpkit: the ranks of this tensor-parallel model (group {comm.name}) ran a forward with "
                            f"different numbers of tensor arguments or parameters ({counts.tolist()}): every rank "
                            f"must run the same model on the same inputs")
    table = comm.all_gather(mine, dim=0).cpu()
    _report(table, comm, inputs, [k for k, _ in replicated], [k for k, _ in split], _input_names(args, kwargs or {}))


def split_samples(named: list[tuple[str, torch.Tensor]], layout_of) -> list[tuple[str, torch.Tensor | None]]:
    """`(key, first values)` of the tensors among `named` that the ranks hold disjoint slices of (`layout_of(key,
    shape)`), None for a constant sample (slices of a constant tensor are equal anyway). The same keys on every
    rank. On a healthy model the non-constant samples differ across ranks; all equal, a broadcast overwrote them."""
    out = []
    for key, p in named:
        lay = layout_of(key, p.shape)
        if lay is not None and not lay.is_replicated and lay.is_plain_split() and not lay.shares_entries():
            sample = p.detach().reshape(-1)[:SAMPLE]
            out.append((key, sample if sample.numel() > 1 and not bool((sample == sample[0]).all()) else None))
    return out


def _report(table: torch.Tensor, comm, inputs: list, replicated: list[str], split: list[str],
            names: list[str]) -> None:
    """Raise what the all-gathered digests (`table[rank, item]`) show, on every rank alike."""
    same = [bool((table[:, i] == table[0, i]).all()) for i in range(table.shape[1])]
    n_in, n_rep = len(inputs), len(replicated)
    differ = [names[i] if i < len(names) else f"argument {i}" for i in range(n_in) if not same[i]]
    if differ:
        raise SentinelError(
            f"tpkit: the ranks of this tensor-parallel model (group {comm.name}) were given different inputs "
            f"({', '.join(differ[:4])} differ). Every rank of a tensor-parallel group must see the same batch: they "
            f"split the model, not the data. A data loader sharded over the whole world does this: transformers' "
            f"Trainer or accelerate's prepare -> use tpkit.trainer.Trainer (tpkit.trainer.SFTTrainer for TRL); a "
            f"DistributedSampler -> shard by the data-parallel rank (tp, dp = tpkit.comm.split(world, tp_size); "
            f"DistributedSampler(dataset, num_replicas=dp.world_size, rank=dp.rank))")
    if all(same[n_in + n_rep:]) and bool((table[0, n_in + n_rep:, 0] == 1).any()):
        raise SentinelError(
            f"tpkit: every split tensor of this tensor-parallel model holds the same values on all ranks of group "
            f"{comm.name} (e.g. {split[0]}): their slices were overwritten by a broadcast. DistributedDataParallel "
            f"or fully_shard wrapped around the model over its own tensor-parallel ranks does this (transformers' "
            f"Trainer and accelerate wrap the model in DDP). Put it under data parallelism with "
            f"tpkit.data_parallel(model, dp_comm) over the data-parallel group only (tp, dp = "
            f"tpkit.comm.split(world, tp_size)), or train with tpkit.trainer.Trainer; the slices are lost: load the "
            f"weights again")
    drifted = [replicated[i - n_in] for i in range(n_in, n_in + n_rep) if not same[i]]
    if drifted:
        raise SentinelError(
            f"tpkit: tensors every rank of this tensor-parallel model holds whole differ across group {comm.name} "
            f"({', '.join(drifted[:4])}{' ...' if len(drifted) > 4 else ''}). Their copies must stay identical; "
            f"the usual cause is gradients clipped with each rank's own norm: torch.nn.utils.clip_grad_norm_ sees only "
            f"this rank's slices, so each rank scales by a different factor. Clip with tpkit.clip_grad_norm_ (the "
            f"global norm); tpkit.check_replicas(model) names the largest differences")


def _refuse_foreign_dtensors(model: nn.Module, record: ModelRecord) -> None:
    if record.data_parallel is not None:
        return
    for key, p in model.named_parameters():
        if hasattr(p, "to_local") and hasattr(p, "device_mesh"):
            raise SentinelError(
                f"tpkit: this tensor-parallel model's parameters are DTensors (e.g. {key}), but tpkit.data_parallel "
                f"did not shard them: fully_shard wrapped around it by hand shards the ranks' different slices as if "
                f"they were one tensor. Use tpkit.data_parallel(model, dp_comm, mode='fsdp') over the data-parallel "
                f"group only (tp, dp = tpkit.comm.split(world, tp_size)), or tpkit.trainer.Trainer")


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _input_names(args: tuple, kwargs: dict) -> list[str]:
    """A name for each tensor leaf of the forward's arguments, in `tree_leaves` order."""
    names = []
    for i, a in enumerate(args):
        names += [f"argument {i}"] * sum(isinstance(t, torch.Tensor) for t in tree_leaves(a))
    for k, v in kwargs.items():
        names += [k] * sum(isinstance(t, torch.Tensor) for t in tree_leaves(v))
    return names


def not_eager() -> bool:
    """Inside torch.compile, or under a dispatch mode (fake tensors, an op recorder): values are not there to check,
    and what tpkit adds to a forward must stay out of what is traced."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def _meta(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Tensors with no values to compare (meta, fake)."""
    from torch._subclasses.fake_tensor import FakeTensor

    first = next(iter(module.parameters()), None)
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if first is not None:
        tensors.append(first)
    return any(t.is_meta or isinstance(t, FakeTensor) for t in tensors)
