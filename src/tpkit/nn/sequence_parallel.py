"""Gradients of replicated parameters under sequence parallelism, summed in the backward itself.

With sequence parallelism a LayerNorm / RMSNorm (or a RowParallelLinear bias) sees only this rank's slice of the
sequence, so its gradient on each rank is a partial sum over that slice; the single-device gradient is the sum over
the tensor-parallel group. `mark_sequence_parallel(module, comm)` registers that sum on the module, by parameter
name (`grad_sums.py`: the parameter enters the module's forward through `copy_to_region`, identity forward,
all-reduce backward), so `backward()` leaves the full gradient, whatever Parameter object the name holds then, and
no step of the training loop can forget it. The converter marks the norms of the sequence-parallel region and
`RowParallelLinear(sequence_parallel=True)` marks its own bias.

Megatron sums these gradients after the backward instead (one bucketed all-reduce the loop must call); tpkit used
to as well. `sync_sequence_parallel_grads` stays for scripts written then: it has nothing left to do.
"""
from __future__ import annotations

import warnings
from typing import Iterable

import torch
from torch import nn

from ..comm.communicator import Communicator
from .grad_sums import sum_grads
from .record import SplitsParameters


def mark_sequence_parallel(module: nn.Module, comm: Communicator | None = None,
                           names: Iterable[str] | None = None) -> None:
    """Sum the gradients of `module`'s own parameters `names` (default all: a norm's, replicated on every rank)
    over the ranks of `comm` (default: `tpkit.get_communicator()`) in every backward from now on. Collective in
    effect: mark the same modules on every rank."""
    from ._layer import resolve_comm

    if not isinstance(module, nn.Module):
        raise TypeError(f"mark_sequence_parallel: pass the module that holds the parameters (a norm, a layer), not "
                        f"{type(module).__name__}: the sum is registered on the module, by parameter name")
    split = module.split_dims() if isinstance(module, SplitsParameters) else {}
    names = [n for n, p in module.named_parameters(recurse=False)] if names is None else list(names)
    bad = [n for n in names if n in split]
    if bad:
        raise ValueError(f"mark_sequence_parallel: {type(module).__name__}.{bad[0]} is a tensor-parallel shard; only "
                         f"replicated parameters need the sequence-parallel gradient sum")
    sum_grads(module, names, resolve_comm(comm))


def sync_sequence_parallel_grads(params: nn.Module | Iterable[torch.Tensor], comm: Communicator | None = None) -> int:
    """Nothing to do: the partial gradients of sequence-parallel parameters are summed in the backward itself
    (`mark_sequence_parallel`). Kept so scripts written for the post-backward sum run unchanged; returns 0."""
    warnings.warn("tpkit.nn.sync_sequence_parallel_grads is no longer needed: sequence-parallel gradients are summed "
                  "in the backward; remove the call", DeprecationWarning, stacklevel=2)
    return 0
