"""The one entry point for collectives on a forward or backward path: eager and `torch.compile` alike.

`all_reduce(t, comm)`, `all_reduce_(t, comm)` (in place, for a temporary the caller owns), `all_gather(t, comm,
dim, sizes)`, `reduce_scatter(t, comm, dim, sizes)` and `all_to_all(t, comm, scatter_dim, gather_dim,
scatter_sizes, gather_sizes)` are what `tpkit.nn.mappings`, cross entropy and the converter's gradient hooks
call. Outside a compiled region they are the communicator's own methods (checks,
TP_DEBUG, `CommError`, the shared-memory transport). Inside one they become graph ops:

- torch.distributed functional collectives (`_c10d_functional` + `wait_tensor`) when the communicator is a
  plain torch process group with no faster transport active, so inductor can schedule them;
- otherwise a `torch.library.custom_op` per collective (`tpkit::all_reduce`, ...), keyed by the integer
  `comm_id` under which every communicator registers itself (`ids.register` / `ids.lookup`): threads, mpi, shared
  memory, wrapped communicators. Their fake impls need nothing but their arguments (the output shape follows
  from the input shape, `sizes` and `rank`), because dynamo may turn the id into a SymInt.

Thread-ranks each have their own communicator, hence their own id: a compiled function recompiles once per
thread-rank; above 8 thread-ranks raise `torch._dynamo.config.cache_size_limit` (`recompile_limit`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from . import all_to_all as a2a
from .checks import check_all_to_all
from .ids import lookup, register
from .ops import ReduceOp
from ..layout import split_sizes

if TYPE_CHECKING:
    from .communicator import Communicator

def _compiling() -> bool:
    return torch.compiler.is_compiling()


def functional_group(comm: "Communicator") -> str | None:
    """The torch process group name functional collectives can use for `comm`, or None when `comm` is not a
    plain torch-backend communicator or a faster transport (shared memory) is active on it."""
    return comm.__dict__.get("_functional_group")


# -- custom ops (threads, mpi, shm, wrapped communicators) ------------------------------------------
@torch.library.custom_op("tpkit::all_reduce", mutates_args=())
def _op_all_reduce(x: torch.Tensor, comm_id: int, op: str) -> torch.Tensor:
    return lookup(comm_id).all_reduce(x, op)


@_op_all_reduce.register_fake
def _(x, comm_id, op):
    return torch.empty_like(x)


@torch.library.custom_op("tpkit::all_reduce_", mutates_args=("x",))
def _op_all_reduce_(x: torch.Tensor, comm_id: int, op: str) -> None:
    lookup(comm_id).all_reduce_(x, op)


@_op_all_reduce_.register_fake
def _(x, comm_id, op):
    return None


@torch.library.custom_op("tpkit::all_gather", mutates_args=())
def _op_all_gather(x: torch.Tensor, comm_id: int, dim: int, sizes: list[int]) -> torch.Tensor:
    return lookup(comm_id).all_gather(x, dim=dim, sizes=sizes)


@_op_all_gather.register_fake
def _(x, comm_id, dim, sizes):
    shape = list(x.shape)
    shape[dim] = sum(sizes)
    return x.new_empty(shape)


@torch.library.custom_op("tpkit::reduce_scatter", mutates_args=())
def _op_reduce_scatter(x: torch.Tensor, comm_id: int, op: str, dim: int, sizes: list[int],
                       rank: int) -> torch.Tensor:
    return lookup(comm_id).reduce_scatter(x, op, dim=dim, sizes=sizes)


@_op_reduce_scatter.register_fake
def _(x, comm_id, op, dim, sizes, rank):
    shape = list(x.shape)
    shape[dim] = sizes[rank]
    return x.new_empty(shape)


@torch.library.custom_op("tpkit::all_to_all", mutates_args=())
def _op_all_to_all(x: torch.Tensor, comm_id: int, scatter_dim: int, gather_dim: int, scatter_sizes: list[int],
                   gather_sizes: list[int], rank: int) -> torch.Tensor:
    return lookup(comm_id).all_to_all(x, scatter_dim, gather_dim, scatter_sizes, gather_sizes)


@_op_all_to_all.register_fake
def _(x, comm_id, scatter_dim, gather_dim, scatter_sizes, gather_sizes, rank):
    return x.new_empty(a2a.output_shape(x.shape, scatter_dim, gather_dim, scatter_sizes, gather_sizes, rank))


# -- functional collectives (torch process groups) ----------------------------------------------------
_FC_OPS = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min", ReduceOp.PRODUCT: "product",
           ReduceOp.AVG: "sum"}


def _fc():
    import torch.distributed._functional_collectives  # noqa: F401 - registers the ops

    return torch.ops._c10d_functional


def _fc_all_reduce(x: torch.Tensor, group: str, op: ReduceOp, n: int) -> torch.Tensor:
    fc = _fc()
    out = fc.wait_tensor(fc.all_reduce(x.contiguous(), _FC_OPS[op], group))
    return out / n if op is ReduceOp.AVG else out


def _fc_all_gather(x: torch.Tensor, group: str, n: int, dim: int, sizes: list[int]) -> torch.Tensor:
    fc = _fc()
    moved = x if dim == 0 else x.movedim(dim, 0)
    longest = max(sizes)
    if moved.shape[0] < longest:  # uneven shards: pad to the longest, gather, cut the padding out
        moved = torch.nn.functional.pad(moved, [0, 0] * (moved.dim() - 1) + [0, longest - moved.shape[0]])
    out = fc.wait_tensor(fc.all_gather_into_tensor(moved.contiguous(), n, group))
    if any(s != longest for s in sizes):
        out = torch.cat([out.narrow(0, r * longest, s) for r, s in enumerate(sizes)], dim=0)
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def _fc_reduce_scatter(x: torch.Tensor, group: str, op: ReduceOp, n: int, rank: int, dim: int,
                       sizes: list[int]) -> torch.Tensor:
    # gloo has no reduce_scatter_tensor: an all-reduce and this rank's slice is the same result, traceably.
    out = _fc_all_reduce(x, group, op, n)
    return out.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()


def _fc_all_to_all(x: torch.Tensor, group: str, rank: int, sd: int, gd: int, ss: list[int],
                   gs: list[int]) -> torch.Tensor:
    # flat, as the eager backend sends it: the split sizes count elements of `all_to_all.pack`'s layout
    fc = _fc()
    send = a2a.send_counts(x.shape, sd, ss)
    recv = a2a.recv_counts(x.shape, sd, gd, ss, gs, rank)
    flat = fc.wait_tensor(fc.all_to_all_single(a2a.pack(x, sd), recv, send, group))
    return a2a.unpack(flat, x.shape, sd, gd, ss, gs, rank, traced=True)


# -- the entry point ------------------------------------------------------------------------------------
def all_reduce(x: torch.Tensor, comm: "Communicator", op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """`comm.all_reduce(x, op)`, traceable. Never modifies `x`."""
    if not _compiling():
        return comm.all_reduce(x, op)
    if comm.world_size == 1:
        return x.clone()
    group = functional_group(comm)
    if group is not None:
        return _fc_all_reduce(x, group, op, comm.world_size)
    return _op_all_reduce(x, comm._comm_id, op.value)


def all_reduce_(x: torch.Tensor, comm: "Communicator", op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """Sum `x` across ranks in place (for a temporary the caller owns and nobody else reads); returns `x`."""
    if not _compiling():
        comm.all_reduce_(x, op)
        return x
    if comm.world_size == 1:
        return x
    group = functional_group(comm)
    if group is not None:
        return x.copy_(_fc_all_reduce(x, group, op, comm.world_size))
    _op_all_reduce_(x, comm._comm_id, op.value)
    return x


def all_gather(x: torch.Tensor, comm: "Communicator", dim: int = 0, sizes: Sequence[int] | None = None):
    """`comm.all_gather(x, dim, sizes)`, traceable (`dim` must be non-negative)."""
    if not _compiling():
        return comm.all_gather(x, dim=dim, sizes=sizes)
    n = comm.world_size
    if n == 1:
        return x.clone()
    sizes = [x.shape[dim]] * n if sizes is None else list(sizes)
    group = functional_group(comm)
    if group is not None:
        return _fc_all_gather(x, group, n, dim, sizes)
    return _op_all_gather(x, comm._comm_id, dim, sizes)


def reduce_scatter(x: torch.Tensor, comm: "Communicator", dim: int = 0, sizes: Sequence[int] | None = None,
                   op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """`comm.reduce_scatter(x, op, dim, sizes)`, traceable (`dim` must be non-negative)."""
    if not _compiling():
        return comm.reduce_scatter(x, op, dim=dim, sizes=sizes)
    n = comm.world_size
    if n == 1:
        return x.clone()
    sizes = split_sizes(x.shape[dim], n) if sizes is None else list(sizes)
    group = functional_group(comm)
    if group is not None:
        return _fc_reduce_scatter(x, group, op, n, comm.rank, dim, sizes)
    return _op_reduce_scatter(x, comm._comm_id, op.value, dim, sizes, comm.rank)


def all_to_all(x: torch.Tensor, comm: "Communicator", scatter_dim: int, gather_dim: int,
               scatter_sizes: Sequence[int] | None = None, gather_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """`comm.all_to_all(x, scatter_dim, gather_dim, scatter_sizes, gather_sizes)`, traceable."""
    if not _compiling():
        return comm.all_to_all(x, scatter_dim, gather_dim, scatter_sizes, gather_sizes)
    n = comm.world_size
    if n == 1:
        return x.clone(memory_format=torch.contiguous_format)
    sd, gd, ss, gs = check_all_to_all(x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, n, comm.rank)
    group = functional_group(comm)
    if group is not None:
        return _fc_all_to_all(x, group, comm.rank, sd, gd, ss, gs)
    return _op_all_to_all(x, comm._comm_id, sd, gd, ss, gs, comm.rank)


__all__ = ["all_gather", "all_reduce", "all_reduce_", "all_to_all", "functional_group", "lookup", "reduce_scatter",
           "register"]
