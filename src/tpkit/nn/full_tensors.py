"""The full tensors of a converted model, gathered from every rank's slices: what a stock tool that saves or counts
the model must see (`save_pretrained`, a PEFT adapter file, `num_parameters`).

`gather_full` is one tensor; `full_state_dict` is a whole state dict, one key at a time (at most one full tensor on
the device at once; the writer keeps them on the CPU). Both are collective: every rank of the model's
tensor-parallel group calls them for the same keys in the same order, and under FSDP2 the data-parallel group too
(each FSDP2 shard is first made whole over dp, `DTensor.full_tensor`); for an expert-parallel model, every rank of
the expert group (each expert from the rank that holds it).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..layout import ShardLayout
from .embedding import ParallelEmbedding, VocabParallelEmbedding
from .record import ModelRecord


def gather_full(local: torch.Tensor, layout: ShardLayout, comm: Communicator) -> torch.Tensor:
    """The full tensor from every rank's slice (collective; a replicated tensor is returned as it is)."""
    if layout.is_replicated:
        return local
    numels = [layout.for_rank(r).local_numel for r in range(comm.world_size)]
    gathered = comm.all_gather(local.detach().reshape(-1), dim=0, sizes=numels)
    pieces, at = [], 0
    for r, n in enumerate(numels):
        pieces.append(gathered.narrow(0, at, n).reshape(layout.for_rank(r).local_shape))
        at += n
    return layout.unshard(pieces)


def tp_local(t: torch.Tensor) -> torch.Tensor:
    """The tensor-parallel slice an FSDP2 shard is part of (an all-gather over dp: collective), any other tensor
    as it is."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


def full_state_dict(record: ModelRecord, state_dict: dict[str, torch.Tensor], keep: bool = True,
                    keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """`{key: full tensor}` of `state_dict` (the record owner's own keys; `keys`: a subset, in order), gathered over
    the record's tensor-parallel group (an expert-parallel model's experts over their expert group, `record.experts`,
    whatever the tp size). Collective. `keep=False` (a rank that writes nothing) gathers and drops each tensor, and
    returns {}; `keep=True` returns them, on the CPU."""
    out = {}
    experts = record.experts
    for key in (keys if keys is not None else list(state_dict)):
        t = tp_local(state_dict[key])
        layout = record.layout(key, t.shape)
        comm = experts.ep if experts is not None and key in experts.keys else record.comm
        full = gather_full(t, layout, comm) if comm is not None and comm.world_size > 1 else t
        if keep:
            out[key] = full.detach().cpu()
    return out


def full_numel(record: ModelRecord, key: str, t: torch.Tensor) -> int:
    """The element count of the full tensor `key`, held here as `t` (an FSDP2 shard's shape is its
    tensor-parallel slice's)."""
    return int(torch.Size(record.layout(key, t.shape).full_shape).numel())


def is_embedding(module: nn.Module) -> bool:
    """An embedding table, plain or split by tpkit (`num_parameters(exclude_embeddings=True)` leaves it out)."""
    return isinstance(module, (nn.Embedding, VocabParallelEmbedding, ParallelEmbedding))
