"""The `threads` backend: N ranks as threads of one process.

For tests, notebooks and simulation (checking a 64-rank plan on a laptop). It keeps the real backends'
semantics: operations match up in issue order, a peer that never arrives raises `CommError` after the
timeout, a rank that fails aborts its peers at once, and shapes or dtypes that differ between ranks are
always reported. Every rank deposits a private copy of its input, so a rank that returns early and then
modifies its tensor cannot disturb a slower peer; reductions run in rank order, so every rank computes
bitwise the same result.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

import torch

from .all_to_all import local, piece_mismatch
from .communicator import Communicator, group_name
from .context import register_world_of_one, use_communicator
from .errors import CommError
from .ops import reduce_tensors

DEFAULT_TIMEOUT = 300.0


class _World:
    """What all thread groups of one run share: one lock and the abort flag."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.aborted: str | None = None

    def abort(self, reason: str) -> None:
        with self.cond:
            if self.aborted is None:
                self.aborted = reason
            self.cond.notify_all()


class _Slot:
    def __init__(self, size: int):
        self.items: list[Any] = [None] * size
        self.arrived = 0
        self.read = 0


class _GroupState:
    """Rendezvous of one group: numbered exchange slots and point-to-point mailboxes."""

    def __init__(self, world: _World, global_ranks: list[int]):
        self.world = world
        self.size = len(global_ranks)
        self.global_ranks = list(global_ranks)
        self.name = group_name(global_ranks, world.size)
        self.issued = [0] * self.size
        self.slots: dict[int, _Slot] = {}
        self.mailboxes: dict[tuple[int, int], deque] = {}

    def _wait(self, ready: Callable[[], bool], op: str, rank: int, timeout: float, missing: Callable[[], str]):
        deadline = time.monotonic() + timeout
        while not ready():
            if self.world.aborted is not None:
                raise CommError(f"{op} on rank {rank} of group {self.name} aborted: {self.world.aborted}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommError(f"{op} on rank {rank} of group {self.name} timed out after {timeout:g}s: "
                                f"{missing()}")
            self.world.cond.wait(min(remaining, 0.5))

    def exchange(self, rank: int, op: str, payload: Any, timeout: float) -> list[Any]:
        """Deposit `(op, payload)` and return every rank's deposit for the same call number."""
        cond = self.world.cond
        with cond:
            seq = self.issued[rank]
            self.issued[rank] += 1
            slot = self.slots.setdefault(seq, _Slot(self.size))
            slot.items[rank] = (op, payload)
            slot.arrived += 1
            cond.notify_all()
            self._wait(lambda: slot.arrived == self.size, op, rank, timeout,
                       lambda: f"ranks {[r for r, item in enumerate(slot.items) if item is None]} never arrived")
            slot.read += 1
            if slot.read == self.size:
                del self.slots[seq]
        ops = [item[0] for item in slot.items]
        if any(o != op for o in ops):
            calls = ", ".join(f"rank {r}: {o}" for r, o in enumerate(ops))
            raise CommError(f"mismatched operations in group {self.name}: {calls}")
        return [item[1] for item in slot.items]

    def post(self, src: int, dst: int, tensor: torch.Tensor) -> None:
        with self.world.cond:
            self.mailboxes.setdefault((src, dst), deque()).append(tensor)
            self.world.cond.notify_all()

    def take(self, src: int, dst: int, timeout: float) -> torch.Tensor:
        with self.world.cond:
            box = self.mailboxes.setdefault((src, dst), deque())
            self._wait(lambda: bool(box), "recv", dst, timeout, lambda: f"rank {src} sent nothing")
            return box.popleft()


def _signature(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tensor.dtype


def _describe(sigs: list[tuple]) -> str:
    return ", ".join(f"rank {r}: shape {s} {d}" for r, (s, d) in enumerate(sigs))


class ThreadCommunicator(Communicator):
    """One thread-rank of a `threads` group. Build a group with `run_threads` or `create_communicators`."""

    backend = "threads"

    def __init__(self, state: _GroupState, rank: int, timeout: float = DEFAULT_TIMEOUT):
        super().__init__(rank, state.size, state.name, timeout)
        self._state: _GroupState | None = state
        self._world = state.world

    def _close(self) -> None:
        self._state = None  # the group's rendezvous goes once every rank has closed

    def _exchange(self, op: str, payload: Any) -> list[Any]:
        return self._state.exchange(self._rank, op, payload, self._timeout)

    def _exchange_checked(self, op: str, mine: torch.Tensor, same_shape: bool, extra: Any = None) -> list:
        """Exchange `mine` (a private copy); raise `CommError` on every rank if the ranks disagree."""
        items = self._exchange(op, (mine, extra))
        sigs = [_signature(t) for t, _ in items]
        dtypes = {d for _, d in sigs}
        if len(dtypes) > 1 or (same_shape and len({s for s, _ in sigs}) > 1):
            raise CommError(f"{op}: ranks of group {self._name} passed mismatched tensors: {_describe(sigs)}")
        extras = [e for _, e in items]
        if any(e != extras[0] for e in extras):
            raise CommError(f"{op}: ranks of group {self._name} passed mismatched arguments: "
                            + ", ".join(f"rank {r}: {e}" for r, e in enumerate(extras)))
        return [t for t, _ in items]

    # Each primitive takes its private copy of the input before returning, so an async operation uses the
    # input as it was when issued, and a peer that reads it later cannot see this rank's later changes.
    def _all_reduce(self, tensor, op, async_op):
        mine = tensor.detach().clone()

        def run():
            return reduce_tensors(self._exchange_checked("all_reduce", mine, True, op.name), op)
        return self._in_background(run, async_op)

    def _all_gather(self, tensor, dim, sizes, async_op):
        mine = tensor.detach().clone()

        def run():
            parts = self._exchange_checked("all_gather", mine, False, (dim, sizes))
            shapes = [list(p.shape) for p in parts]
            for s in shapes:
                if dim < len(s):
                    s[dim] = -1
            if any(s != shapes[0] for s in shapes):
                raise CommError(f"all_gather: shards of group {self._name} differ outside dim {dim}: "
                                f"{_describe([_signature(p) for p in parts])}")
            if sizes is None and len({p.shape[dim] for p in parts}) > 1:
                raise CommError(f"all_gather: shards of group {self._name} differ in dim {dim} and no sizes were "
                                f"given: {_describe([_signature(p) for p in parts])}; pass sizes= for uneven shards")
            return torch.cat(parts, dim=dim)
        return self._in_background(run, async_op)

    def _all_to_all(self, tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes, async_op):
        mine = tensor.detach().clone()
        call = (scatter_dim, gather_dim, tuple(scatter_sizes), tuple(gather_sizes))

        def run():
            items = self._exchange("all_to_all", (mine, call))
            if len({t.dtype for t, _ in items}) > 1 or len({t.dim() for t, _ in items}) > 1:
                raise CommError(f"all_to_all: ranks of group {self._name} passed mismatched tensors: "
                                f"{_describe([_signature(t) for t, _ in items])}")
            problem = piece_mismatch([(tuple(t.shape), *c) for t, c in items])
            if problem:
                raise CommError(f"all_to_all: ranks of group {self._name} passed calls that do not fit together: "
                                f"{problem}")
            pieces = []
            for t, (_, _, sizes, _) in items:  # rank i's piece for this rank, from its own cut
                pieces.append(t.narrow(scatter_dim, sum(sizes[:self._rank]), sizes[self._rank]))
            return local(mine, scatter_dim, gather_dim, scatter_sizes, gather_sizes, self._rank, pieces)
        return self._in_background(run, async_op)

    def _reduce_scatter(self, tensor, op, dim, sizes, async_op):
        mine = tensor.detach().clone()

        def run():
            parts = self._exchange_checked("reduce_scatter", mine, True, (op.name, dim, tuple(sizes)))
            start = sum(sizes[:self._rank])
            return reduce_tensors([p.narrow(dim, start, sizes[self._rank]) for p in parts], op)
        return self._in_background(run, async_op)

    def _broadcast(self, tensor, src, async_op):
        mine = tensor.detach().clone()

        def run():
            parts = self._exchange_checked("broadcast", mine, True, src)
            return parts[src].clone()  # src too: peers may still be reading its copy
        return self._in_background(run, async_op)

    def _barrier(self):
        self._exchange("barrier", None)

    def _send(self, tensor, dst):
        self._state.post(self._rank, dst, tensor.detach().clone())

    def _recv(self, tensor, src):
        got = self._state.take(src, self._rank, self._timeout)
        if _signature(got) != _signature(tensor):
            raise CommError(f"recv: rank {src} of group {self._name} sent shape {tuple(got.shape)} {got.dtype} but "
                            f"rank {self._rank} expects shape {tuple(tensor.shape)} {tensor.dtype}")
        with torch.no_grad():
            tensor.copy_(got)
        return tensor

    def _new_group(self, members):
        # The lowest member builds the shared state; the exchange hands it to the other members and checks
        # that every rank asked for the same group.
        state = None
        if self._rank == members[0]:
            state = _GroupState(self._state.world, [self._state.global_ranks[m] for m in members])
        states = self._exchange("new_group", (tuple(members), state))
        if any(m != states[0][0] for m, _ in states):
            raise CommError(f"new_group: ranks of group {self._name} asked for different members: "
                            + ", ".join(f"rank {r}: {list(m)}" for r, (m, _) in enumerate(states)))
        if self._rank not in members:
            return None
        return ThreadCommunicator(states[members[0]][1], members.index(self._rank), self._timeout)


def create_communicators(world_size: int, timeout: float | None = None) -> list[ThreadCommunicator]:
    """All `world_size` thread-rank communicators of a new group, for code that runs its own threads."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    state = _GroupState(_World(world_size), list(range(world_size)))
    return [ThreadCommunicator(state, r, DEFAULT_TIMEOUT if timeout is None else timeout) for r in range(world_size)]


def abort(comms: list[ThreadCommunicator], reason: str) -> None:
    """Wake every rank of the run waiting in a collective with `CommError(reason)`."""
    if comms:
        comms[0]._world.abort(reason)


def run_threads(fn: Callable[[ThreadCommunicator], Any], world_size: int, timeout: float | None = None) -> list:
    """Run `fn(comm)` on `world_size` thread-ranks; return the results in rank order.

    A rank that raises aborts the others (their waits raise `CommError` at once instead of timing out),
    and the first real failure is re-raised, marked with its rank.
    """
    comms = create_communicators(world_size, timeout)
    return run_on_threads(lambda comm: fn(comm), comms)


def run_on_threads(fn: Callable[[ThreadCommunicator], Any], comms: list[ThreadCommunicator]) -> list:
    """Run `fn(comm)` on one thread per communicator and gather results or the root failure.

    Each thread's default communicator (`tpkit.get_communicator()`, layers built with `comm=None`) is its own."""
    results: list[Any] = [None] * len(comms)
    errors: list[BaseException | None] = [None] * len(comms)

    def body(rank: int) -> None:
        try:
            with use_communicator(comms[rank]):
                results[rank] = fn(comms[rank])
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors[rank] = exc
            abort(comms, f"rank {rank} failed with {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=body, args=(r,), name=f"tpkit-rank{r}", daemon=True)
               for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    raise_first_failure(errors)
    return results


def raise_first_failure(errors: list[BaseException | None]) -> None:
    """Re-raise the failure that caused the others: the lowest rank whose error is not a knock-on CommError."""
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    aborted = [(r, e) for r, e in failed if isinstance(e, CommError) and "aborted:" in str(e)]
    root = [(r, e) for r, e in failed if (r, e) not in aborted] or failed
    rank, exc = root[0]
    mark_rank(exc, rank)
    raise exc


def mark_rank(exc: BaseException, rank: int) -> None:
    """Record on an exception which rank raised it (attribute `rank`, and a note in its traceback)."""
    try:
        exc.rank = rank  # type: ignore[attr-defined]
    except AttributeError:
        pass
    note = f"raised on rank {rank}"
    if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", []):
        exc.add_note(note)


register_world_of_one(lambda: create_communicators(1)[0])
