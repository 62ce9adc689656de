"""Fault injection: a rank dies (SIGKILL) or a write fails (ENOSPC) at a named point, for the tests of training
that survives.

Real processes under torchrun cannot be monkeypatched from the test, so the faults are chosen by one environment
variable, which torchrun passes to every worker of every generation:

    TPKIT_FAULTS="save-files:rank=1:step=20; forward:rank=3:step=7:generation=1; write:rank=0:step=30:do=enospc"

Each entry (`;`-separated) is a point and `key=value`s: `rank` (the world rank that fails; required), `step` (the
training step; default any), `generation` (torchrun's restart count, default 0: a fault fires in one generation,
so the restarted job gets past it), `do`: `kill` (SIGKILL this process; the default) or `enospc` (raise
`OSError(ENOSPC)`, as a full disk does). The points tpkit calls:

    step          the training loop, before the forward (examples/train_2d.py)
    forward       inside the forward, between blocks (a pre-hook on a middle block): the rank dies while its peers
                  wait in a collective
    save-start    save_sharded, before this rank writes anything
    save-files    save_sharded, after this rank's file is written and fsynced, before the manifest
    save-latest   save_sharded, rank 0, after the manifest is written, before `latest` moves
    write         inside the writer of this rank's file, after its first tensor (`do=enospc`: a full disk)

Unset, `at()` costs one environment lookup.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import signal

from .distributed import restart_count

VARIABLE = "TPKIT_FAULTS"
POINTS = ("step", "forward", "save-start", "save-files", "save-latest", "write")
ACTIONS = ("kill", "enospc")


@dataclasses.dataclass(frozen=True)
class Fault:
    point: str
    rank: int
    step: int | None = None
    generation: int = 0
    do: str = "kill"


def parse(text: str) -> list[Fault]:
    """The faults `text` (the variable's value) names; ValueError naming the entry when one is malformed."""
    out = []
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        point, *fields = entry.split(":")
        if point not in POINTS:
            raise ValueError(f"{VARIABLE}: unknown point {point!r} in {entry!r}; valid: {', '.join(POINTS)}")
        values: dict = {}
        for field in fields:
            key, sep, value = field.partition("=")
            if not sep or key not in ("rank", "step", "generation", "do"):
                raise ValueError(f"{VARIABLE}: {field!r} in {entry!r} is not rank=, step=, generation= or do=")
            values[key] = value if key == "do" else int(value)
        if "rank" not in values:
            raise ValueError(f"{VARIABLE}: {entry!r} names no rank (add :rank=N)")
        if values.get("do", "kill") not in ACTIONS:
            raise ValueError(f"{VARIABLE}: do={values['do']!r} in {entry!r}; valid: {', '.join(ACTIONS)}")
        out.append(Fault(point, **values))
    return out


def at(point: str, rank: int, step: int | None = None, path: str | None = None) -> None:
    """Fail here if a fault names this point, rank, step and generation; return otherwise. `path`: the file being
    written, for the ENOSPC error."""
    text = os.environ.get(VARIABLE)
    if not text:
        return
    generation = restart_count()
    for f in parse(text):
        if f.point == point and f.rank == rank and f.generation == generation and f.step in (None, step):
            if f.do == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            print(f"tpkit fault: killing rank {rank} at {point} (step {step}, generation {generation})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
