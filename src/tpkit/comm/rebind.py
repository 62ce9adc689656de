"""A communicator inside a model that is copied or pickled: a connection to the other ranks, not data.

`copy.deepcopy(model)` shares the communicators the model refers to (a copy of a model talks to the same ranks;
a lock or a process group cannot be copied). Pickling (`torch.save(model)`, a process pool) stores a
communicator as "rank r of the group named g of N ranks" (the group's name is its members' ranks in the world,
`communicator.group_name`), and unpickling binds the live communicator of this process (or thread-rank) that is
that rank of that group: the default one, or a group made from it (`tpkit.comm.split`, `new_group`). Where no
such communicator lives, unpickling raises and says what to create first: never a guess.
"""
from __future__ import annotations

from typing import Any

from .context import current_thread_communicator, process_communicator, world_of_one
from .ids import live

Communicator = Any  # (this module sits below communicator.py, which pickles through it)


def root_of(comm: "Communicator") -> "Communicator":
    """The world communicator `comm` was made from by `new_group` (itself for a world)."""
    return comm.__dict__.get("_root") or comm


def rebind(name: str, rank: int, world_size: int) -> "Communicator":
    """The live communicator that is rank `rank` of the group `name` of `world_size` ranks, made from this
    process's (or thread-rank's) default world; the newest one when a group was made twice."""
    current = current_thread_communicator() or process_communicator()
    if current is None and (name, rank, world_size) == ("world", 0, 1):
        return world_of_one()
    if current is not None:
        if _is(current, name, rank, world_size):
            return current
        world = root_of(current)
        found = [c for c in live() if _is(c, name, rank, world_size) and root_of(c) is world]
        if found:
            return found[-1]
    here = "no default communicator" if current is None else f"the default communicator is {current!r}"
    raise RuntimeError(f"a tensor-parallel model was pickled on rank {rank} of group {name} ({world_size} ranks); "
                       f"this process has no live communicator for that group ({here}). Unpickle it on the same "
                       f"rank after tpkit.init() and, for a group of a bigger world, after making that group "
                       f"again (tpkit.comm.split / new_group); or load a checkpoint with tpkit.load_sharded, which "
                       f"takes any world size")


def _is(comm: "Communicator", name: str, rank: int, world_size: int) -> bool:
    return (comm.name, comm.rank, comm.world_size) == (name, rank, world_size) and not comm.closed
