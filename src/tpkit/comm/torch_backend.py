"""The `torch` backend: a `Communicator` over a `torch.distributed` process group (nccl, gloo or mpi).

It adds nothing on the hot path but what the contract needs: a copy of the input for all_reduce (so the
input is never modified), a `movedim` for `dim != 0`, and padding for uneven shards. Operations a
backend lacks are composed: gloo has no AVG, so it sums and divides. Under `TP_DEBUG=1` every collective
first compares the ranks' shapes and dtypes and raises `CommError` on a mismatch instead of corrupting
memory or hanging.
"""
from __future__ import annotations

import datetime
from typing import Callable

import torch
import torch.distributed as dist

from .communicator import Communicator, Handle, debug_enabled
from .errors import CommError
from .ops import ReduceOp, divide_by_count

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_OP_CODES = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3, "broadcast": 4}
_DTYPE_CODES: dict[torch.dtype, int] = {}
# Subgroups made by members only (use_local_synchronization) are named by their ranks in torch; asking for
# the same ranks twice must reuse the group rather than collide.
_LOCAL_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.setdefault(dtype, len(_DTYPE_CODES) + 1)


class TorchCommunicator(Communicator):
    """One rank of a `torch.distributed` process group (the default world group unless `group` is given)."""

    backend = "torch"

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: float | None = None, name: str | None = None):
        if not dist.is_initialized():
            raise CommError("torch.distributed is not initialised; call tpkit.init() (or "
                            "torch.distributed.init_process_group) first")
        self._group = group if group is not None else dist.group.WORLD
        self._global_ranks = dist.get_process_group_ranks(self._group)
        self._pg_backend = dist.get_backend(self._group)
        super().__init__(dist.get_rank(self._group), dist.get_world_size(self._group),
                         name or ("world" if group is None else f"world{self._global_ranks}"),
                         timeout if timeout is not None else 1800.0)
        self._native_avg = self._pg_backend == "nccl"

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The underlying torch process group, for code that calls torch.distributed directly."""
        return self._group

    @property
    def torch_backend(self) -> str:
        """`nccl`, `gloo` or `mpi`."""
        return self._pg_backend

    def _scratch_device(self) -> torch.device:
        if self._pg_backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- helpers ----------------------------------------------------------------------------------
    def _handle(self, work, finish: Callable[[], torch.Tensor]) -> Handle:
        def wait() -> torch.Tensor:
            work.wait()
            return finish()
        return Handle(wait, work.is_completed)

    def _check_peers(self, op: str, tensor: torch.Tensor, dim: int = -1, extra: int = 0) -> None:
        """Under TP_DEBUG: compare every rank's (op, dtype, shape) and raise CommError on a mismatch."""
        if not debug_enabled():
            return
        shape = list(tensor.shape)[:8]
        if op == "all_gather" and dim >= 0:
            shape[dim] = -1  # shards may differ here when sizes are given
        sig = [_OP_CODES.get(op, 0), _dtype_code(tensor.dtype), tensor.dim(), extra] + shape + [0] * (8 - len(shape))
        mine = torch.tensor(sig, dtype=torch.int64, device=self._scratch_device())
        every = torch.empty(self._world_size * mine.numel(), dtype=torch.int64, device=mine.device)
        _all_gather_single(every, mine, group=self._group)
        rows = every.view(self._world_size, -1).tolist()
        if any(row != rows[0] for row in rows):
            names = {v: k for k, v in _OP_CODES.items()}
            dtypes = {v: k for k, v in _DTYPE_CODES.items()}
            desc = ", ".join(f"rank {r}: {names.get(row[0], '?')} {dtypes.get(row[1], '?')} shape {row[4:4 + row[2]]}"
                             for r, row in enumerate(rows))
            raise CommError(f"{op}: ranks of group {self._name} passed mismatched tensors or arguments: {desc}")

    # -- primitives -------------------------------------------------------------------------------
    def _all_reduce(self, tensor, op, async_op):
        self._check_peers("all_reduce", tensor, extra=list(ReduceOp).index(op))
        out = tensor.clone()
        if op is ReduceOp.AVG and self._native_avg and out.is_floating_point():
            return self._handle(dist.all_reduce(out, dist.ReduceOp.AVG, group=self._group, async_op=True),
                                lambda: out)
        work = dist.all_reduce(out, _TORCH_OPS.get(op, dist.ReduceOp.SUM), group=self._group, async_op=True)
        if op is ReduceOp.AVG:
            return self._handle(work, lambda: divide_by_count(out, self._world_size))
        return self._handle(work, lambda: out)

    def _all_gather(self, tensor, dim, sizes, async_op):
        self._check_peers("all_gather", tensor, dim=dim)
        moved = tensor if dim == 0 else tensor.movedim(dim, 0).contiguous()
        n = self._world_size
        longest = moved.shape[0] if sizes is None else max(sizes)
        if sizes is not None and moved.shape[0] < longest:
            padded = moved.new_zeros((longest,) + tuple(moved.shape[1:]))
            padded[: moved.shape[0]] = moved
            moved = padded
        out = moved.new_empty((n * longest,) + tuple(moved.shape[1:]))
        work = _all_gather_single(out, moved, group=self._group, async_op=True)

        def finish() -> torch.Tensor:
            full = out
            if sizes is not None and any(s != longest for s in sizes):
                full = torch.cat([out.narrow(0, r * longest, s) for r, s in enumerate(sizes)], dim=0)
            return full if dim == 0 else full.movedim(0, dim).contiguous()
        return self._handle(work, finish)

    def _reduce_scatter(self, tensor, op, dim, sizes, async_op):
        self._check_peers("reduce_scatter", tensor, extra=list(ReduceOp).index(op))
        moved = tensor if dim == 0 else tensor.movedim(dim, 0).contiguous()
        n = self._world_size
        longest = max(sizes)
        if any(s != longest for s in sizes):
            padded = moved.new_zeros((n * longest,) + tuple(moved.shape[1:]))
            start = 0
            for r, s in enumerate(sizes):
                padded[r * longest: r * longest + s] = moved[start: start + s]
                start += s
            moved = padded
        out = moved.new_empty((longest,) + tuple(moved.shape[1:]))
        native_avg = op is ReduceOp.AVG and self._native_avg and out.is_floating_point()
        torch_op = dist.ReduceOp.AVG if native_avg else _TORCH_OPS.get(op, dist.ReduceOp.SUM)
        work = _reduce_scatter_single(out, moved, op=torch_op, group=self._group, async_op=True)
        mine = sizes[self._rank]

        def finish() -> torch.Tensor:
            piece = out if mine == longest else out.narrow(0, 0, mine)
            if op is ReduceOp.AVG and not native_avg:
                piece = divide_by_count(piece, n)
            return piece if dim == 0 else piece.movedim(0, dim).contiguous()
        return self._handle(work, finish)

    def _broadcast(self, tensor, src, async_op):
        self._check_peers("broadcast", tensor, extra=src)
        out = tensor.clone() if self._rank == src else torch.empty_like(tensor)
        work = dist.broadcast(out, self._global_ranks[src], group=self._group, async_op=True)
        return self._handle(work, lambda: out)

    def _barrier(self):
        token = torch.zeros(1, device=self._scratch_device())
        dist.all_reduce(token, group=self._group)

    def _send(self, tensor, dst):
        dist.send(tensor, self._global_ranks[dst], group=self._group)

    def _recv(self, tensor, src):
        if tensor.is_contiguous():
            dist.recv(tensor, self._global_ranks[src], group=self._group)
            return tensor
        buf = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        dist.recv(buf, self._global_ranks[src], group=self._group)
        with torch.no_grad():
            tensor.copy_(buf)
        return tensor

    def _new_group(self, members):
        global_members = [self._global_ranks[m] for m in members]
        timeout = datetime.timedelta(seconds=self._timeout)
        if self._group is dist.group.WORLD:
            # Every process of the world calls this, in the same order: torch's ordinary collective creation.
            group = dist.new_group(global_members, timeout=timeout, backend=self._pg_backend)
            if self._rank not in members:
                return None
        else:
            # Only this subgroup's processes call this; the rest of the world must not be waited for.
            if self._rank not in members:
                return None
            key = tuple(global_members)
            group = _LOCAL_GROUPS.get(key)
            if group is None:
                group = dist.new_group(global_members, timeout=timeout, backend=self._pg_backend,
                                       use_local_synchronization=True)
                _LOCAL_GROUPS[key] = group
        return TorchCommunicator(group, self._timeout, name=f"world{global_members}")
