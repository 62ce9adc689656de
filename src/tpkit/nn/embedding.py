"""Embeddings split over the vocabulary (`VocabParallelEmbedding`) or over the embedding dim (`ParallelEmbedding`).

VocabParallelEmbedding holds rows `[start, end)` of the table (`partition_dim` 0): ids outside that range look up
row 0 and are then zeroed, and one all-reduce sums the ranks' outputs, so each token gets exactly its one row.
It is the choice for large vocabularies (and pairs with `vocab_parallel_cross_entropy` on a column-parallel
LM head). ParallelEmbedding holds a slice of every row's features (`partition_dim` 1) and all-gathers the
output; it has no masking cost but gathers `embedding_dim` activations.

`padding_idx` behaves as in `nn.Embedding` (its row starts at zero and gets no gradient). `max_norm`,
`scale_grad_by_freq` and `sparse` are not supported. At world size 1 `forward` is `F.embedding`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.communicator import Communicator
from ..comm.debug import debug_enabled
from ._layer import (TensorParallelModule, check_module, check_positive, check_sequence_divisible, full_module,
                     make_shard)
from .linear import Adapter
from .mappings import gather_from_region, reduce_from_region, reduce_scatter_to_sequence_region
from .partition import partition_sizes

# nn.Embedding options a sharded embedding cannot reproduce exactly (the converter checks them too).
UNSUPPORTED_EMBEDDING_OPTIONS = {"max_norm": None, "scale_grad_by_freq": False, "sparse": False}


def _check_ids(layer: str, ids: torch.Tensor, num_embeddings: int, comm: Communicator) -> None:
    """Reject ids the single-device lookup would reject, without a host sync: a device-side assertion
    (`torch._assert_async`, which also runs in compiled graphs). Under TP_DEBUG=1 (eager only) first say which ids
    are out of range and check that every rank got ids of the same shape and values."""
    if ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{layer}: ids must be an integer tensor, got {ids.dtype}")
    if not torch.compiler.is_compiling() and debug_enabled():
        _describe_ids(layer, ids, num_embeddings, comm)
    torch._assert_async(((ids >= 0) & (ids < num_embeddings)).all(),
                        f"{layer}: ids must be in 0..{num_embeddings - 1} (num_embeddings); set TP_DEBUG=1 to see "
                        f"which were not")


def _describe_ids(layer: str, ids: torch.Tensor, num_embeddings: int, comm: Communicator) -> None:
    """The TP_DEBUG checks (they read values: host syncs): which ids are out of range; same ids on every rank."""
    bad = ids[(ids < 0) | (ids >= num_embeddings)]
    if bad.numel():
        values = bad.unique().tolist()
        raise IndexError(f"{layer}: ids must be in 0..{num_embeddings - 1} (num_embeddings); got {len(values)} "
                         f"distinct out-of-range value(s): {values[:10]}{' ...' if len(values) > 10 else ''}")
    shape = list(ids.shape)[:6]
    mine = torch.tensor([[ids.dim(), ids.numel(), int(ids.long().sum())] + shape + [-1] * (6 - len(shape))],
                        dtype=torch.int64, device=ids.device)
    every = comm.all_gather(mine, dim=0).tolist()
    if any(row != every[0] for row in every):
        raise ValueError(f"{layer}: ranks passed different ids (the input must be replicated): "
                         + ", ".join(f"rank {r}: shape {tuple(v for v in row[3:] if v >= 0)} sum {row[2]}"
                                     for r, row in enumerate(every)))


class _ParallelEmbedding(TensorParallelModule):
    PARTITION_DIMS: dict[str, int | None] = {"weight": 0}

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None, comm: Communicator | None,
                 chunk: int, even: bool, device, dtype, _full: nn.Embedding | None = None):
        super().__init__()
        name = type(self).__name__
        check_positive(name, num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"{name}: padding_idx {padding_idx} must be within num_embeddings "
                                 f"({num_embeddings})")
            padding_idx %= num_embeddings
        self._set_comm(comm)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        dim = self.PARTITION_DIMS["weight"]
        split, what = (num_embeddings, "num_embeddings") if dim == 0 else (embedding_dim, "embedding_dim")
        self.partition_sizes = tuple(partition_sizes(split, self.world_size, chunk, layer=name, what=what, even=even))
        if _full is None:
            _full = full_module(lambda **kw: nn.Embedding(num_embeddings, embedding_dim, padding_idx, **kw),
                                device, dtype)
        self.weight = make_shard(_full.weight, dim, self.partition_sizes, self.rank, device=device, dtype=dtype,
                                 requires_grad=_full.weight.requires_grad)

    @classmethod
    def from_module(cls, module: nn.Embedding, comm: Communicator | None = None, *, device=None, dtype=None,
                    **kwargs):
        """This rank's shard of an existing `nn.Embedding` (meta modules give meta shards; copies except at
        world size 1, where the module's own tensor is used)."""
        check_module(cls.__name__, module, nn.Embedding, UNSUPPORTED_EMBEDDING_OPTIONS)
        return cls(module.num_embeddings, module.embedding_dim, module.padding_idx, comm=comm, device=device,
                   dtype=dtype, _full=module, **kwargs)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return (f"{self.num_embeddings}, {self.embedding_dim}{pad}, world_size={self.world_size}, rank={self.rank}, "
                f"local_weight={tuple(self.weight.shape)}")


class VocabParallelEmbedding(_ParallelEmbedding):
    """An embedding table whose rows (the vocabulary) are split over ranks; output is replicated (all-reduce)
    or, with `sequence_parallel=True`, reduce-scattered along `sequence_dim`."""

    PARTITION_DIMS = {"weight": 0}

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 comm: Communicator | None = None, *, sequence_parallel: bool = False, sequence_dim: int = -2,
                 chunk: int = 1, even: bool = False, device=None, dtype: torch.dtype | None = None, **private):
        super().__init__(num_embeddings, embedding_dim, padding_idx, comm, chunk, even, device, dtype, **private)
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), int(sequence_dim)
        self.vocab_start = sum(self.partition_sizes[:self.rank])
        self.vocab_end = self.vocab_start + self.partition_sizes[self.rank]
        local_pad = None
        if padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            local_pad = self.padding_idx - self.vocab_start
        self.local_padding_idx = local_pad

    def forward(self, ids: torch.Tensor, adapter: Adapter | None = None) -> torch.Tensor:
        """`adapter` (a LoRA branch, `tpkit.nn.lora_embedding`): called on the ids as this rank's rows number them
        (ids outside its vocabulary read row 0); its result is zeroed with the shard's for those ids, so it is a
        partial sum like the shard's lookup and joins the one all-reduce."""
        if self.world_size == 1:
            out = F.embedding(ids, self.weight, self.padding_idx)
            return out if adapter is None else out + adapter(ids)
        _check_ids("VocabParallelEmbedding", ids, self.num_embeddings, self.comm)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight, self.local_padding_idx)
        if adapter is not None:
            out = out + adapter(local)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            check_sequence_divisible("VocabParallelEmbedding", out, self.sequence_dim, self.world_size)
            return reduce_scatter_to_sequence_region(out, self.comm, self.sequence_dim)
        return reduce_from_region(out, self.comm, inplace=True)  # `out` is this layer's own temporary


class ParallelEmbedding(_ParallelEmbedding):
    """An embedding table whose columns (embedding features) are split over ranks; the output is all-gathered
    to the full `embedding_dim` unless `gather_output=False`."""

    PARTITION_DIMS = {"weight": 1}

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 comm: Communicator | None = None, *, gather_output: bool = True, chunk: int = 1, even: bool = False,
                 device=None, dtype: torch.dtype | None = None, **private):
        super().__init__(num_embeddings, embedding_dim, padding_idx, comm, chunk, even, device, dtype, **private)
        self.gather_output = bool(gather_output)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        _check_ids("ParallelEmbedding", ids, self.num_embeddings, self.comm)
        out = F.embedding(ids, self.weight, self.padding_idx)
        if self.gather_output:
            out = gather_from_region(out, self.comm, -1, self.partition_sizes)
        return out
