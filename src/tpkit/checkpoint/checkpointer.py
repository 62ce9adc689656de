"""`Checkpointer`: periodic checkpoints of a training run, and the resume after torchrun restarts it.

A job that survives a dead rank is a loop that can start at any step:

    ckpt = tpkit.Checkpointer("run/ckpt", every=50, keep=3)
    start = ckpt.resume(model, opt, sched)          # 0 when nothing is saved yet
    for step in range(start, total):
        train(batch(step))                          # the data is a function of the step
        ckpt.maybe_save(step + 1, model, opt, sched, extra={"epoch": ...})

Under `torchrun --max-restarts R`, a killed rank takes its generation down and the next one resumes from the
newest complete version. What makes the continuation equal an uninterrupted run: parameters and optimizer
state (`save_sharded`, atomic), the LR scheduler's state, every rank's random streams (torch's CPU and CUDA
generators, Python's `random`, NumPy's global generator, and the TP dropout tracker, which `save_sharded` keeps),
and the data order, which the caller derives from the step (a sampler seeded by the epoch, a generator seeded by
the step; a loader position goes into `extra`). Everything is JSON or safetensors: nothing read back is
unpickled.

The run's replicas are watched too: from `resume` (or the first save) on, `tpkit.watch_replicas` checks every
`check_replicas_every` optimizer steps (default 50) that tensors several ranks hold are the same on each, so a
silent divergence raises `ReplicaError` from `optimizer.step()` before a checkpoint keeps it;
`check_replicas_every=None` turns it off, and `replica_tolerance={glob: relative}` names tensors that kernels with
atomics compute on CUDA (see `tpkit.replicas`).

`resume` takes the newest version with a manifest (complete, whether or not `latest` had moved to it); if it
fails its checksums (a damaged disk) it warns and falls back to the next older one, which `keep` leaves there.
"""
from __future__ import annotations

import json
import os
import random
import warnings

import torch
from torch import nn

from ..nn._layer import resolve_comm
from ..replicas import watch_replicas
from .agree import gather_bytes
from .errors import CheckpointError
from .load import load_sharded
from .manifest import versions
from .save import save_sharded

_KEY = "tpkit.checkpointer"  # its section of a version's `extra`


class Checkpointer:
    """Save every `every` steps under `directory` (collective; atomic; the newest `keep` complete versions kept),
    and resume from the newest complete one. `comm`: the world communicator (default: `tpkit.get_communicator()`).
    After `resume`, `extra` is the `extra` dict that was saved with the version resumed from (else {})."""

    def __init__(self, directory: str | os.PathLike, every: int, keep: int | None = 2, comm=None,
                 check_replicas_every: int | None = 50, replica_tolerance: dict[str, float] | None = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Checkpointer: every must be a positive int (steps between saves), got {every!r}")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"Checkpointer: keep must be a positive int (versions kept) or None, got {keep!r}")
        self.directory, self.every, self.keep, self.comm = os.fspath(directory), every, keep, comm
        self.check_replicas_every, self.replica_tolerance, self.watch = check_replicas_every, replica_tolerance, None
        self.extra: dict = {}

    def _watch(self, model: nn.Module, optimizer) -> None:
        """Watch the replicas of `model` through `optimizer`'s steps (once per optimizer)."""
        if self.check_replicas_every and optimizer is not None and \
                (self.watch is None or self.watch.optimizer is not optimizer):
            if self.watch is not None:
                self.watch.remove()
            self.watch = watch_replicas(model, optimizer, every=self.check_replicas_every, comm=None,
                                        tolerance=self.replica_tolerance)

    def resume(self, model: nn.Module, optimizer, scheduler=None) -> int:
        """Load the newest complete version into `model`, `optimizer` and `scheduler`, restore the random streams,
        and return its step; 0 when nothing is saved. Collective."""
        comm = resolve_comm(self.comm)
        self._watch(model, optimizer)
        names = _from_rank0(comm, [name for _, name, ok in reversed(versions(self.directory)) if ok])
        failures = []
        for name in names:
            try:
                meta = load_sharded(model, os.path.join(self.directory, name), optimizer=optimizer, comm=comm)
            except CheckpointError as exc:  # raised on every rank alike, before anything changed
                failures.append(f"{name}: {exc}")
                if comm.rank == 0:
                    warnings.warn(f"Checkpointer: {name} does not load ({exc}); trying an older version",
                                  stacklevel=2)
                continue
            saved = (meta.get("extra") or {}).get(_KEY, {})
            self.extra = saved.get("user") or {}
            if scheduler is not None and saved.get("scheduler") is not None:
                scheduler.load_state_dict(saved["scheduler"])
            streams = saved.get("rng") or []
            if len(streams) == comm.world_size:
                set_rng_state(streams[comm.rank])
            elif comm.rank == 0:
                warnings.warn(f"Checkpointer: {name} was saved by {len(streams)} ranks, this run has "
                              f"{comm.world_size}: random streams start afresh", stacklevel=2)
            return int(meta.get("step") or 0)
        if failures:
            raise CheckpointError(f"{self.directory}: no complete version loads: " + "; ".join(failures))
        self.extra = {}
        return 0

    def maybe_save(self, step: int, model: nn.Module, optimizer, scheduler=None,
                   extra: dict | None = None) -> str | None:
        """`save` when `step` (steps done so far) is a multiple of `every`; returns the version directory or None."""
        if step <= 0 or step % self.every:
            return None
        return self.save(step, model, optimizer, scheduler, extra)

    def save(self, step: int, model: nn.Module, optimizer, scheduler=None, extra: dict | None = None) -> str:
        """Save now as version `step`, with the scheduler, every rank's random streams and `extra` (JSON)."""
        comm = resolve_comm(self.comm)
        self._watch(model, optimizer)
        section = {"user": extra or {}, "scheduler": scheduler.state_dict() if scheduler is not None else None}
        try:
            json.dumps(section)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"Checkpointer.save: extra and the scheduler's state_dict must be JSON ({exc})") from None
        section["rng"] = [json.loads(b) for b in gather_bytes(comm, json.dumps(rng_state()).encode())]
        return save_sharded(model, self.directory, optimizer=optimizer, step=step, comm=comm,
                            extra={_KEY: section}, keep=self.keep)


def _from_rank0(comm, names: list[str]) -> list[str]:
    """Rank 0's list (every rank must try the same versions in the same order)."""
    return json.loads(gather_bytes(comm, json.dumps(names).encode())[0])


def rng_state() -> dict:
    """This process's random streams as JSON: torch's CPU generator (and CUDA's, when initialised), Python's
    `random` and NumPy's global generator."""
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": bytes(torch.get_rng_state().tolist()).hex(), "python": _jsonable(random.getstate()),
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [bytes(s.tolist()).hex() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    import numpy as np

    torch.set_rng_state(torch.tensor(list(bytes.fromhex(state["torch"])), dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(list(bytes.fromhex(h)), dtype=torch.uint8) for h in state["cuda"]])


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x
