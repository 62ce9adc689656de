"""Argument checks and size rules shared by every backend: raised as `ValueError` or `TypeError` before any
peer is involved, each naming the operation and the argument.

`Communicator` binds these to its group (`_check_dim`, `_check_rank`, ...); the hot collectives inline the
common case and call here only when it does not hold.
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch

from ..layout import split_sizes


def as_index(value) -> int | None:
    """`value` as an int if it is an integer (Python, numpy or 0-d integer tensor); None otherwise."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_tensor(op: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(tensor).__name__}")


def average_of_bool(op: str) -> TypeError:
    """The error for ReduceOp.AVG on a bool tensor (the caller tests, since the test is on the hot path)."""
    return TypeError(f"{op}: ReduceOp.AVG has no meaning for bool tensors; use MAX (any) or MIN (all), "
                     "or convert to an integer or float dtype first")


def check_dim(op: str, tensor: torch.Tensor, dim: int, what: str = "dim") -> int:
    """`dim` as an index in 0..ndim-1 (negative counts from the end); `what` names the argument in errors."""
    ndim = tensor.dim()
    if ndim == 0:
        raise ValueError(f"{op}: needs a tensor with at least one dimension, got a 0-d tensor; "
                         f"use tensor.reshape(1)")
    index = as_index(dim)
    if index is None or not -ndim <= index < ndim:
        raise ValueError(f"{op}: {what} {dim!r} is out of range for a tensor of shape {tuple(tensor.shape)} "
                         f"(valid: {-ndim}..{ndim - 1})")
    return index % ndim


def check_rank(op: str, rank: int, what: str, group: str, world_size: int, me: int, allow_self: bool = True) -> int:
    """`rank` as a rank of `group` (whose own rank is `me`); `allow_self=False` for point-to-point peers."""
    index = as_index(rank)
    if index is None or not 0 <= index < world_size:
        raise ValueError(f"{op}: {what} {rank!r} is not a rank of group {group} (ranks 0..{world_size - 1})")
    if not allow_self and index == me:
        raise ValueError(f"{op}: {what} {rank} is this rank itself; a rank cannot {op} to itself")
    return index


def check_gather_sizes(tensor: torch.Tensor, dim: int, sizes, world_size: int, me: int) -> list[int] | None:
    """all_gather's `sizes`: one non-negative size per rank, this rank's equal to its tensor's size in `dim`."""
    if sizes is None:  # wrappers (AlgorithmCommunicator) pass the caller's value through
        return None
    sizes = [int(s) for s in sizes]
    if len(sizes) != world_size or min(sizes) < 0:
        raise ValueError(f"all_gather: sizes {sizes} must have one non-negative entry per rank ({world_size})")
    if sizes[me] != tensor.shape[dim]:
        raise ValueError(f"all_gather: sizes[{me}] = {sizes[me]} but this rank's tensor has "
                         f"size {tensor.shape[dim]} in dim {dim} (shape {tuple(tensor.shape)})")
    return sizes


def scatter_sizes(tensor: torch.Tensor, dim: int, sizes, world_size: int) -> list[int]:
    """reduce_scatter's pieces along `dim`: `split_sizes` (the first ranks take one extra when `dim` does not
    divide) unless `sizes` gives them, which must then be non-negative and add up to the size of `dim`."""
    if sizes is None:
        return split_sizes(tensor.shape[dim], world_size)
    sizes = [int(s) for s in sizes]
    if len(sizes) != world_size or sum(sizes) != tensor.shape[dim] or min(sizes) < 0:
        raise ValueError(
            f"reduce_scatter: sizes {sizes} must have {world_size} non-negative entries summing to "
            f"the size of dim {dim} ({tensor.shape[dim]}) of the input of shape {tuple(tensor.shape)}")
    return sizes


def _index_list(op: str, what: str, sizes, world_size: int) -> list[int]:
    """`sizes` as a list of `world_size` non-negative ints, or a ValueError naming `what`."""
    try:
        values = [as_index(s) for s in sizes]
    except TypeError:
        values = [None]
    if None in values or len(values) != world_size or min(values, default=0) < 0:
        raise ValueError(f"{op}: {what} {sizes!r} must be {world_size} non-negative ints, one per rank")
    return values  # type: ignore[return-value]


def check_all_to_all(tensor: torch.Tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes, world_size: int,
                     me: int) -> tuple[int, int, list[int], list[int]]:
    """all_to_all's arguments normalised: (scatter_dim, gather_dim, scatter_sizes, gather_sizes), dims in
    0..ndim-1 and both lists resolved (see `Communicator.all_to_all` for the defaults).

    What one rank can check alone: the pieces it cuts add up to its scatter dim, and the piece it sends to itself
    is the one it expects back from itself (gather_sizes[me]). Whether the ranks' lists agree with each other is
    checked by the threads backend always, by the others under TP_DEBUG.
    """
    op = "all_to_all"
    sd = check_dim(op, tensor, scatter_dim, "scatter_dim")
    gd = check_dim(op, tensor, gather_dim, "gather_dim")
    shape = tuple(tensor.shape)
    if scatter_sizes is None:
        scatter_sizes = split_sizes(shape[sd], world_size)
    else:
        scatter_sizes = _index_list(op, "scatter_sizes", scatter_sizes, world_size)
        if sum(scatter_sizes) != shape[sd]:
            raise ValueError(f"{op}: scatter_sizes {scatter_sizes} add up to {sum(scatter_sizes)}, but scatter_dim {sd} "
                             f"of the input of shape {shape} has size {shape[sd]}; pass sizes that add up to it, or "
                             f"omit scatter_sizes for the even split {split_sizes(shape[sd], world_size)}")
    own = shape[gd] if sd != gd else scatter_sizes[me]
    if gather_sizes is None:
        return sd, gd, scatter_sizes, [own] * world_size
    gather_sizes = _index_list(op, "gather_sizes", gather_sizes, world_size)
    if gather_sizes[me] != own:
        where = (f"this rank's input has size {own} in gather_dim {gd} (shape {shape})" if sd != gd else
                 f"this rank keeps scatter_sizes[{me}] = {own} of its own input (scatter_dim = gather_dim = {gd})")
        raise ValueError(f"{op}: gather_sizes[{me}] = {gather_sizes[me]} but {where}; gather_sizes[i] is the size of "
                         f"the piece received from rank i, so gather_sizes[{me}] must be {own}")
    return sd, gd, scatter_sizes, gather_sizes


def check_group_ranks(ranks: Sequence[int], group: str, world_size: int) -> list[int]:
    """new_group's `ranks`: distinct ranks of `group`, sorted."""
    try:
        indices = [as_index(r) for r in ranks]
    except TypeError:
        indices = [None]
    if None in indices:
        raise ValueError(f"new_group: ranks must be a sequence of ints, got {ranks!r}")
    members = sorted(indices)  # type: ignore[type-var]
    if not members:
        raise ValueError("new_group: ranks is empty; a group needs at least one rank")
    if len(set(members)) != len(members):
        raise ValueError(f"new_group: ranks {list(ranks)} contain duplicates")
    bad = [r for r in members if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"new_group: ranks {bad} are not ranks of group {group} (ranks 0..{world_size - 1})")
    return members
