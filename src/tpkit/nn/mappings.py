"""The conjugate communication pairs every tensor-parallel layer is made of, as autograd Functions.

Each mapping is a forward collective whose backward is its adjoint, so gradients are exact by
construction: the adjoint of "every rank gets the sum" (all-reduce) is "the gradient is already whole"
(identity), the adjoint of "split" is "all-gather", and the adjoint of "all-gather" is "reduce-scatter"
(when the gathered tensor feeds different computations on each rank) or "split" (when it feeds the same
replicated computation). Layers only compose these; none of them talks to the communicator directly.

Tensor-parallel region (features, last dim by default):
    copy_to_region          forward identity        backward all-reduce
    reduce_from_region      forward all-reduce      backward identity
    scatter_to_region       forward split           backward all-gather
    gather_from_region      forward all-gather      backward split
Sequence-parallel region (the sequence dim, `dim`):
    scatter_to_sequence_region         forward split            backward all-gather
    gather_from_sequence_region        forward all-gather       backward reduce-scatter
    reduce_scatter_to_sequence_region  forward reduce-scatter   backward all-gather
Exchanging one dim for another (heads for sequence in Ulysses attention, tokens to their experts):
    all_to_all                         forward all-to-all       backward the reverse all-to-all
                                       (scatter -> gather dim)  (gather -> scatter dim, size lists swapped)
Parameters a rank uses for part of the work only (applied to the parameter where its module reads it; see
`grad_sums`):
    copy_to_region               forward the parameter        backward all-reduce of its gradient
                                 (a per-head norm every rank holds whole but applies to its own heads)
    copy_rows_to_region          forward the parameter        backward each row's gradient summed over the
                                 ranks holding it (KV heads replicated when fewer than ranks; each holder's
                                 gradient covers only its query heads)

A gradient counted once over several ranks, or averaged by an engine that does not know it (no communication):
    scale_grad                   forward identity         backward the gradient times `times`, over `over`

Every mapping returns its input unchanged, without creating an autograd node, when the world size is 1. Where
autograd records nothing (inference), the three a decoded token calls (`copy_to_region`, `reduce_from_region`,
`gather_from_region`) run their forward directly, without an autograd.Function.
Uneven sizes follow `tpkit.comm.split_sizes` unless `sizes` (every rank's size along `dim`) is given.

Every collective goes through `tpkit.comm.traceable` (the communicator's own method in eager mode, a
functional collective or a `tpkit::` custom op under `torch.compile`), so the pairs compile with no graph
break; nothing here reads a tensor's values.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..comm import traceable
from ..comm.checks import check_all_to_all
from ..comm.communicator import Communicator
from ..layout import split_sizes
from .partition import shard


def _split(x: torch.Tensor, comm: Communicator, dim: int, sizes: Sequence[int] | None) -> torch.Tensor:
    """This rank's piece of `x` along `dim` (the shared split rule unless `sizes` says otherwise)."""
    sizes = split_sizes(x.shape[dim], comm.world_size) if sizes is None else sizes
    if sum(sizes) != x.shape[dim] or len(sizes) != comm.world_size:
        raise ValueError(f"split: sizes {list(sizes)} do not cut dim {dim} of size {x.shape[dim]} (shape "
                         f"{tuple(x.shape)}) into {comm.world_size} pieces")
    return shard(x, dim, sizes, comm.rank).contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return traceable.all_reduce(grad, ctx.comm), None


def _sum(x: torch.Tensor, comm: Communicator, inplace: bool) -> torch.Tensor:
    """`reduce_from_region`'s forward. In place only on a temporary the calling layer owns and nobody else reads
    (its partial product); compiled graphs take the out-of-place op: the compiler reuses buffers itself."""
    if inplace and not torch.compiler.is_compiling():
        traceable.all_reduce_(x, comm)
        return x
    return traceable.all_reduce(x, comm)


def _recorded(x: torch.Tensor) -> bool:
    """Whether autograd records an op on `x` here. Where it does not (inference, `no_grad`, a tensor that needs no
    gradient) a mapping is its forward alone: an autograd.Function's apply costs Python on every call, and an eager
    decoded token calls a few per layer."""
    return torch.is_grad_enabled() and x.requires_grad


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, inplace):
        if inplace and not torch.compiler.is_compiling():
            ctx.mark_dirty(x)
        return _sum(x, comm, inplace)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim, sizes):
        ctx.comm, ctx.dim = comm, dim
        ctx.sizes = list(split_sizes(x.shape[dim], comm.world_size) if sizes is None else sizes)
        return _split(x, comm, dim, ctx.sizes)

    @staticmethod
    def backward(ctx, grad):
        return traceable.all_gather(grad.contiguous(), ctx.comm, ctx.dim, ctx.sizes), None, None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim, sizes):
        ctx.comm, ctx.dim, ctx.sizes = comm, dim, sizes
        return traceable.all_gather(x, comm, dim, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.comm, ctx.dim, ctx.sizes), None, None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim, sizes):
        ctx.comm, ctx.dim, ctx.sizes = comm, dim, sizes
        return traceable.all_gather(x, comm, dim, sizes)

    @staticmethod
    def backward(ctx, grad):
        return traceable.reduce_scatter(grad.contiguous(), ctx.comm, ctx.dim, ctx.sizes), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim, sizes):
        ctx.comm, ctx.dim = comm, dim
        ctx.sizes = list(split_sizes(x.shape[dim], comm.world_size) if sizes is None else sizes)
        return traceable.reduce_scatter(x, comm, dim, ctx.sizes)

    @staticmethod
    def backward(ctx, grad):
        return traceable.all_gather(grad.contiguous(), ctx.comm, ctx.dim, ctx.sizes), None, None, None


class _CopyRowsToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, rows, full_rows, comm):
        ctx.rows, ctx.full_rows, ctx.comm = rows, full_rows, comm
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):
        # Scatter-add every rank's rows into the full dim 0, one all-reduce, this rank's rows back: a row held by
        # one rank keeps its own gradient, one held by several gets the sum.
        idx = torch.tensor(ctx.rows, dtype=torch.long, device=grad.device)
        full = grad.new_zeros((ctx.full_rows,) + tuple(grad.shape[1:]))
        full.index_add_(0, idx, grad)
        return traceable.all_reduce_(full, ctx.comm).index_select(0, idx), None, None, None  # `full` is ours


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, scatter_dim, gather_dim, scatter_sizes, gather_sizes):
        # the lists resolved here, so the backward sends back exactly the pieces that came
        sd, gd, ss, gs = check_all_to_all(x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, comm.world_size,
                                          comm.rank)
        ctx.comm, ctx.dims, ctx.sizes = comm, (sd, gd), (ss, gs)
        return traceable.all_to_all(x, comm, sd, gd, ss, gs)

    @staticmethod
    def backward(ctx, grad):
        (sd, gd), (ss, gs) = ctx.dims, ctx.sizes
        return traceable.all_to_all(grad, ctx.comm, gd, sd, gs, ss), None, None, None, None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, times, over):
        ctx.times, ctx.over = times, over
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.times != 1:
            grad = grad * ctx.times
        return (grad / ctx.over if ctx.over != 1 else grad), None, None


def _dim(x: torch.Tensor, dim: int) -> int:
    """A non-negative dim, so forward and backward agree even if a rank's shard changes rank."""
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def copy_to_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input: identity forward, all-reduce of the gradient."""
    return x if comm.world_size == 1 or not _recorded(x) else _CopyToRegion.apply(x, comm)


def copy_rows_to_region(p: torch.Tensor, rows: Sequence[int], full_rows: int, comm: Communicator) -> torch.Tensor:
    """A tensor whose dim-0 rows several ranks hold (`rows`: this rank's, as positions in the full dim 0 of
    `full_rows`): identity forward; backward, each row's gradient summed over its holders. Every rank of the
    group takes part, one whose rows are all single included."""
    return p if comm.world_size == 1 else _CopyRowsToRegion.apply(p, tuple(rows), int(full_rows), comm)


def reduce_from_region(x: torch.Tensor, comm: Communicator, inplace: bool = False) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results: all-reduce forward, identity backward.

    `inplace=True` sums into `x` itself (`all_reduce_`): only for a temporary the caller made and owns."""
    if comm.world_size == 1:
        return x
    return _ReduceFromRegion.apply(x, comm, inplace) if _recorded(x) else _sum(x, comm, inplace)


def scatter_to_region(x: torch.Tensor, comm: Communicator, dim: int = -1,
                      sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Keep this rank's piece of `dim` (forward); all-gather the gradient pieces (backward)."""
    return x if comm.world_size == 1 else _ScatterToRegion.apply(x, comm, _dim(x, dim), sizes)


def gather_from_region(x: torch.Tensor, comm: Communicator, dim: int = -1,
                       sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's piece along `dim` (forward); keep this rank's piece of the gradient."""
    if comm.world_size == 1:
        return x
    if not _recorded(x):
        return traceable.all_gather(x, comm, _dim(x, dim), sizes)
    return _GatherFromRegion.apply(x, comm, _dim(x, dim), sizes)


def scatter_to_sequence_region(x: torch.Tensor, comm: Communicator, dim: int = 0,
                               sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Split the sequence dim (forward); all-gather the gradient (backward). Same as `scatter_to_region`."""
    return x if comm.world_size == 1 else _ScatterToRegion.apply(x, comm, _dim(x, dim), sizes)


def gather_from_sequence_region(x: torch.Tensor, comm: Communicator, dim: int = 0,
                                sizes: Sequence[int] | None = None) -> torch.Tensor:
    """All-gather the sequence dim (forward); reduce-scatter the gradient (backward), because every rank used
    the full sequence for its own partial computation. `sizes` must be given for unequal shards."""
    return x if comm.world_size == 1 else _GatherFromSequence.apply(x, comm, _dim(x, dim), sizes)


def reduce_scatter_to_sequence_region(x: torch.Tensor, comm: Communicator, dim: int = 0,
                                      sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Sum partial results and keep this rank's piece of the sequence (forward); all-gather the gradient."""
    return x if comm.world_size == 1 else _ReduceScatterToSequence.apply(x, comm, _dim(x, dim), sizes)


def all_to_all(x: torch.Tensor, comm: Communicator, scatter_dim: int, gather_dim: int,
               scatter_sizes: Sequence[int] | None = None, gather_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """`comm.all_to_all` (forward: this rank's pieces of `scatter_dim` to every rank, theirs concatenated along
    `gather_dim`); backward the reverse all-to-all, `gather_dim` scattered by `gather_sizes` and `scatter_dim`
    gathered by `scatter_sizes` (the defaults resolved in the forward). Dims may be negative."""
    if comm.world_size == 1:
        return x
    return _AllToAll.apply(x, comm, scatter_dim, gather_dim, scatter_sizes, gather_sizes)


def scale_grad(x: torch.Tensor, times: float = 1, over: float = 1) -> torch.Tensor:
    """Identity forward; backward multiplies the gradient by `times` and divides it by `over` (`x` itself, with no
    node, when both are 1)."""
    return x if times == 1 and over == 1 else _ScaleGrad.apply(x, times, over)


__all__ = [
    "all_to_all", "copy_rows_to_region", "copy_to_region", "gather_from_region", "gather_from_sequence_region",
    "reduce_from_region", "reduce_scatter_to_sequence_region", "scale_grad", "scatter_to_region",
    "scatter_to_sequence_region",
]
