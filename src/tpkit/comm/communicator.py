"""`Communicator`: the one interface every layer talks through, whatever carries the bytes.

The base class owns everything that must behave the same on every backend: argument checks (raised as
`ValueError` before any peer is involved; the rules live in `checks.py`), the `dim` handling, uneven splits,
`TP_DEBUG` logging (`debug.py`), turning backend failures into `CommError`, and the async `Handle`
(`handle.py`). A backend implements a handful of primitives, each of which receives already-validated
arguments and returns a `Handle`; backends that compare the ranks' calls under TP_DEBUG use `signatures.py`.
"""
from __future__ import annotations

import abc
from typing import Sequence

import torch

from . import checks
from .all_to_all import via_all_gather
from .debug import debug_enabled, log_call, logger  # noqa: F401 - logger: see below
from .errors import PASS_THROUGH, CommError, Guard
from .handle import Handle
from .lifetime import Lifetime
from .ops import ReduceOp
from ..layout import split_sizes
# logger and these signature names lived here before their modules were split out: still importable from here
from .signatures import (SIGNATURE_LENGTH, check_signatures, describe_signature, dtype_of_code,  # noqa: F401
                         sent_shape, signature)
from .ids import register
from .rebind import rebind, root_of


def group_name(global_ranks: Sequence[int], world_size: int) -> str:
    """`world` for the whole world, else `world[0, 2]` (the members' ranks in the world): the same names on
    every backend, so an error message says which processes to look at."""
    ranks = list(global_ranks)
    return "world" if ranks == list(range(world_size)) else f"world{ranks}"


class Communicator(Lifetime, abc.ABC):
    """A group of `world_size` ranks that run collectives together; this object is one of them.

    Collectives return a new tensor and never modify their input. `recv` is the one exception: it fills
    the buffer it is given, as its name says. Results are detached: a collective is not differentiable by
    itself (the autograd-aware pairs live in `tpkit.nn.mappings`), on every backend and every world size.
    With `async_op=True` the input must stay unchanged until `wait()` returns, as with torch.distributed.

    `close()` (or leaving a `with` block) releases what the communicator holds; see `close`.
    """

    backend: str = "abstract"

    def __init__(self, rank: int, world_size: int, name: str, timeout: float):
        self._rank = rank
        self._world_size = world_size
        self._name = name
        self._timeout = float(timeout)
        self._executor = None
        self._pending: list = []
        self._debug = False
        self._closed = False
        register(self)  # the integer id compiled graphs name this communicator by (traceable.py)

    # -- identity ---------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def name(self) -> str:
        """A readable name of the group, used in errors and logs."""
        return self._name

    @property
    def timeout(self) -> float:
        """Seconds an operation may wait for its peers before raising `CommError`."""
        return self._timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group={self._name!r}, rank={self._rank}, world_size={self._world_size})"

    # -- copies and pickles (`rebind.py`): a connection to the other ranks, not data ----------------
    def __deepcopy__(self, memo) -> "Communicator":
        return self

    def __copy__(self) -> "Communicator":
        return self

    def __reduce__(self):
        return rebind, (self.name, self.rank, self.world_size)

    # -- public collectives -----------------------------------------------------------------------
    # The collectives run on every layer's forward and backward, so their common path is kept to a few
    # inline checks (a type test, a dim range, one dictionary lookup for TP_DEBUG) and no object beyond the
    # result: failures are turned into CommError by `except` clauses (free until something raises) rather
    # than a context object, and synchronous calls return the tensor without a Handle. Everything else
    # (TP_DEBUG logging and the ranks' signature checks, argument errors) is on slow paths.
    def _reduce_start(self, name: str, tensor: torch.Tensor, op: ReduceOp | str) -> ReduceOp:
        """The inline checks both all-reduce forms make before any communication; returns the parsed op."""
        if op.__class__ is not ReduceOp:
            op = ReduceOp.parse(op)
        if not isinstance(tensor, torch.Tensor):
            self._check_tensor(name, tensor)
        if op is ReduceOp.AVG and tensor.dtype is torch.bool:
            raise checks.average_of_bool(name)
        self._debug = debug_enabled()
        if self._debug:
            self._log(name, tensor, op=op.name)
        return op

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False):
        """Combine `tensor` across ranks with `op`; every rank gets the result."""
        op = self._reduce_start("all_reduce", tensor, op)
        if self._world_size == 1:
            return self._finish(Handle.completed(tensor.detach().clone()), async_op)
        try:
            if async_op:
                return self._finish(self._all_reduce(tensor.contiguous(), op, True), True, "all_reduce")
            return self._all_reduce_now(tensor.contiguous(), op)
        except PASS_THROUGH:
            raise
        except Exception as exc:
            raise self._error("all_reduce", exc) from exc

    def all_reduce_(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM) -> torch.Tensor:
        """`all_reduce` IN PLACE: `tensor` becomes the result and is returned. The one collective that modifies
        its input, for temporaries a layer owns (a row-parallel layer's partial product); synchronous."""
        op = self._reduce_start("all_reduce_", tensor, op)
        if self._world_size == 1:
            return tensor
        try:
            if self._pending:
                self._drain()
            self._all_reduce_(tensor, op)
            return tensor
        except PASS_THROUGH:
            raise
        except Exception as exc:
            raise self._error("all_reduce_", exc) from exc

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Sequence[int] | None = None,
                   async_op: bool = False):
        """Concatenate every rank's `tensor` along `dim`, in rank order.

        Shards may differ in size along `dim` when `sizes` (every rank's size there) is given; all other
        dimensions must match.
        """
        if not isinstance(tensor, torch.Tensor):
            self._check_tensor("all_gather", tensor)
        ndim = tensor.dim()
        if dim.__class__ is int and ndim and -ndim <= dim < ndim:
            dim %= ndim
        else:
            dim = self._check_dim("all_gather", tensor, dim)
        if sizes is not None:
            sizes = self._check_gather_sizes(tensor, dim, sizes)
        self._debug = debug_enabled()
        if self._debug:
            self._log("all_gather", tensor, dim=dim)
        if self._world_size == 1:
            return self._finish(Handle.completed(tensor.detach().clone()), async_op)
        try:
            handle = self._all_gather(tensor.contiguous(), dim, sizes, async_op)
            return self._finish(handle, True, "all_gather") if async_op else handle.wait()
        except PASS_THROUGH:
            raise
        except Exception as exc:
            raise self._error("all_gather", exc) from exc

    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int,
                   scatter_sizes: Sequence[int] | None = None, gather_sizes: Sequence[int] | None = None,
                   async_op: bool = False):
        """Cut `tensor` along `scatter_dim`, piece j (`scatter_sizes[j]`, default the even split) to rank j; return
        the pieces received concatenated in rank order along `gather_dim` (`gather_sizes[i]` from rank i; default:
        every rank's size there is this rank's or, for one dim, `scatter_sizes[rank]`), a new contiguous tensor.
        Other dims match on every rank. Two dims: every rank passes the same `scatter_sizes`; one dim: its own send
        and receive sizes, as torch's `all_to_all_single` (MoE dispatch). The layout: `all_to_all.py`."""
        if not isinstance(tensor, torch.Tensor):
            self._check_tensor("all_to_all", tensor)
        sd, gd, scatter_sizes, gather_sizes = checks.check_all_to_all(
            tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes, self._world_size, self._rank)
        self._debug = debug_enabled()
        if self._debug:
            self._log("all_to_all", tensor, scatter_dim=sd, gather_dim=gd, scatter_sizes=scatter_sizes,
                      gather_sizes=gather_sizes)
        if self._world_size == 1:
            alone = tensor.detach().clone(memory_format=torch.contiguous_format)
            return self._finish(Handle.completed(alone), async_op)
        try:
            handle = self._all_to_all(tensor, sd, gd, scatter_sizes, gather_sizes, async_op)
            return self._finish(handle, True, "all_to_all") if async_op else handle.wait()
        except PASS_THROUGH:
            raise
        except Exception as exc:
            raise self._error("all_to_all", exc) from exc

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, dim: int = 0,
                       sizes: Sequence[int] | None = None, async_op: bool = False):
        """Reduce `tensor` across ranks, then give each rank its piece along `dim`.

        Pieces follow `split_sizes` (the first ranks take one extra when `dim` does not divide) unless
        `sizes` says otherwise.
        """
        if op.__class__ is not ReduceOp:
            op = ReduceOp.parse(op)
        if not isinstance(tensor, torch.Tensor):
            self._check_tensor("reduce_scatter", tensor)
        if op is ReduceOp.AVG and tensor.dtype is torch.bool:
            raise checks.average_of_bool("reduce_scatter")
        ndim = tensor.dim()
        if dim.__class__ is int and ndim and -ndim <= dim < ndim:
            dim %= ndim
        else:
            dim = self._check_dim("reduce_scatter", tensor, dim)
        if sizes is None:
            sizes = split_sizes(tensor.shape[dim], self._world_size)
        else:
            sizes = self._check_scatter_sizes(tensor, dim, sizes)
        self._debug = debug_enabled()
        if self._debug:
            self._log("reduce_scatter", tensor, op=op.name, dim=dim)
        if self._world_size == 1:
            return self._finish(Handle.completed(tensor.detach().clone()), async_op)
        try:
            handle = self._reduce_scatter(tensor.contiguous(), op, dim, sizes, async_op)
            return self._finish(handle, True, "reduce_scatter") if async_op else handle.wait()
        except PASS_THROUGH:
            raise
        except Exception as exc:
            raise self._error("reduce_scatter", exc) from exc

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Every rank gets `src`'s tensor; other ranks' `tensor` only gives the shape and dtype."""
        self._check_tensor("broadcast", tensor)
        src = self._check_rank("broadcast", src, "src")
        self._log("broadcast", tensor, src=src)
        if self._world_size == 1:
            return self._finish(Handle.completed(tensor.detach().clone()), async_op)
        with self._guard("broadcast"):
            return self._finish(self._broadcast(tensor.contiguous(), src, async_op), async_op, "broadcast")

    def barrier(self, async_op: bool = False) -> Handle | None:
        """Return once every rank of the group has called `barrier`.

        With `async_op=True`, return at once with a `Handle` whose `wait()` returns None once every rank has
        arrived (the seed's BarrierAsync), ordered with this communicator's other async operations."""
        self._log("barrier", None)
        if self._world_size == 1:
            return Handle.completed(None) if async_op else None
        with self._guard("barrier"):
            if async_op:
                return self._finish(self._barrier_async(), True, "barrier")
            self._drain()
            self._barrier()
        return None

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send `tensor` to rank `dst` of this group (matched by a `recv` there)."""
        self._check_tensor("send", tensor)
        dst = self._check_rank("send", dst, "dst", allow_self=False)
        self._log("send", tensor, dst=dst)
        with self._guard("send"):
            self._drain()
            self._send(tensor.contiguous(), dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive from rank `src` into `tensor` (whose shape and dtype must match the sent one); return it."""
        self._check_tensor("recv", tensor)
        src = self._check_rank("recv", src, "src", allow_self=False)
        self._log("recv", tensor, src=src)
        with self._guard("recv"):
            self._drain()
            return self._recv(tensor, src)

    def new_group(self, ranks: Sequence[int]) -> "Communicator | None":
        """A communicator over `ranks` (ranks of this group); None on ranks that are not members.

        Collective: every rank of this group calls it with the same `ranks`, in the same order as its other
        `new_group` calls. Members are renumbered 0..k-1 in ascending order of their rank here.
        """
        members = self._check_group_ranks(ranks)
        self._log("new_group", None, ranks=members)
        with self._guard("new_group"):
            self._drain()
            group = self._new_group(members)
        if group is not None:
            group.__dict__["_root"] = root_of(self)
        return group

    # -- backend primitives -----------------------------------------------------------------------
    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Handle: ...

    def _all_reduce_now(self, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        """Synchronous all-reduce returning the tensor; backends with a faster synchronous path (no Handle,
        no closure) override this."""
        return self._all_reduce(tensor, op, False).wait()

    def _all_reduce_(self, tensor: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        """In-place all-reduce; backends with a native in-place path override this copy-back default."""
        result = self._all_reduce(tensor.contiguous(), op, False).wait()
        with torch.no_grad():
            return tensor.copy_(result)

    @abc.abstractmethod
    def _all_gather(self, tensor: torch.Tensor, dim: int, sizes: list[int] | None, async_op: bool) -> Handle: ...

    def _all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int, scatter_sizes: list[int],
                    gather_sizes: list[int], async_op: bool) -> Handle:
        """`tensor` may be non-contiguous (backends pack it once: `all_to_all.pack`). This default, two all-gathers,
        is synchronous even for async_op and moves n times the bytes; tpkit's backends override it."""
        return Handle.completed(via_all_gather(self, tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes))

    @abc.abstractmethod
    def _reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp, dim: int, sizes: list[int],
                        async_op: bool) -> Handle: ...

    @abc.abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Handle: ...

    @abc.abstractmethod
    def _barrier(self) -> None: ...

    def _barrier_async(self) -> Handle:
        """A barrier that returns at once; by default the blocking one on this communicator's worker thread
        (which keeps it in order with the other async operations). Backends with a native one override."""
        def run() -> None:
            self._barrier()
        return self._in_background(run, True)

    @abc.abstractmethod
    def _send(self, tensor: torch.Tensor, dst: int) -> None: ...

    @abc.abstractmethod
    def _recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def _new_group(self, members: list[int]) -> "Communicator | None": ...

    def _gather_signatures(self, mine: list[int]) -> list[list[int]]:
        """Every rank's signature (a short list of ints), for `TP_DEBUG` checks; backends that check always
        (threads) need not implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not gather TP_DEBUG signatures")

    # -- helpers for backends ---------------------------------------------------------------------
    def _check_peers(self, op: str, tensor: torch.Tensor, **details) -> None:
        """Under TP_DEBUG: compare every rank's signature (op, dtype, shape, arguments); CommError if any differ."""
        if self._debug:
            check_signatures(op, self._name, self._gather_signatures(signature(op, tensor, **details)))

    def _finish(self, handle: Handle, async_op: bool, op: str = ""):
        if async_op:
            raw_wait = handle._wait

            def wait() -> torch.Tensor:
                with self._guard(op or "async operation"):
                    return raw_wait()

            handle._wait = wait
            return handle
        return handle.wait()

    def _guard(self, op: str) -> Guard:
        """A context that turns any backend failure into `CommError` naming the operation and the group."""
        return Guard(self, op)

    def _error(self, op: str, exc: BaseException) -> CommError:
        """The `CommError` a backend failure `exc` in `op` becomes (the hot collectives raise it from their
        `except` clause; the others through `_guard`)."""
        return CommError(f"{op} failed on rank {self._rank} of group {self._name} "
                         f"(world size {self._world_size}): {exc}")

    def _log(self, opname: str, tensor: torch.Tensor | None, **details) -> None:
        """Log the call under TP_DEBUG, and note in `self._debug` whether TP_DEBUG is on for this call (the
        backends' mismatch checks look there). Every public operation reads TP_DEBUG exactly once: the hot
        collectives read it themselves and call this only when it is on; the others call this first."""
        self._debug = debug_enabled()
        if self._debug:
            log_call(opname, tensor, details, self._name, self._rank, self._world_size, self.backend)

    # -- argument checks (the rules are in checks.py; these bind them to this group) ----------------
    def _check_tensor(self, op: str, tensor) -> None:
        checks.check_tensor(op, tensor)

    def _check_dim(self, op: str, tensor: torch.Tensor, dim: int) -> int:
        return checks.check_dim(op, tensor, dim)

    def _check_rank(self, op: str, rank: int, what: str, allow_self: bool = True) -> int:
        return checks.check_rank(op, rank, what, self._name, self._world_size, self._rank, allow_self)

    def _check_gather_sizes(self, tensor: torch.Tensor, dim: int, sizes) -> list[int] | None:
        return checks.check_gather_sizes(tensor, dim, sizes, self._world_size, self._rank)

    def _check_scatter_sizes(self, tensor: torch.Tensor, dim: int, sizes) -> list[int]:
        return checks.scatter_sizes(tensor, dim, sizes, self._world_size)

    def _check_group_ranks(self, ranks: Sequence[int]) -> list[int]:
        return checks.check_group_ranks(ranks, self._name, self._world_size)
