"""Dropout on a LoRA adapter's input under tensor parallelism: one mask for the one model the ranks hold together.

PEFT drops elements of the adapter's input before A (`lora_dropout`). Split over ranks, that mask decides whether
the ranks still hold one model:

- on a column base every rank multiplies the same whole input by the whole A, and A's gradient is summed over the
  ranks: every rank must drop the same elements, or the summed gradient mixes different models and the replicas
  of A (and of what follows) drift apart;
- on a row base each rank holds a slice of the input's features: its mask must be its slice of one full mask, or
  the full input would be dropped by a mask no single model uses.

Both come from one rule: draw the full input's mask from a stream that is the same on every TP rank, and keep
the features this rank holds. The stream is the RNG tracker's `DATA_PARALLEL_RNG` (`tpkit.nn.random`), seeded
the same on the TP ranks of a dp rank by `model_parallel_manual_seed` / `data_parallel_manual_seed`; not torch's
default generator, which thread-ranks share and which other code advances differently per rank. The draw is
F.dropout's on CPU (`bernoulli_(1 - p) / (1 - p)` of the full input's shape and dtype), so one process whose
default generator is in the stream's state draws the same masks (CUDA's fused dropout draws differently; the
ranks still agree with each other). A recompute (`tpkit.recompute`) replays the tracker, so it draws them again.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..comm.communicator import Communicator
from ..comm.ids import lookup
from .random import DATA_PARALLEL_RNG, get_rng_tracker


@torch.library.custom_op("tpkit::lora_dropout_mask", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _draw_mask(like: torch.Tensor, full: int, p: float, comm_id: int, where: str) -> torch.Tensor:
    """The full input's mask (`like`'s shape with `full` features, its dtype and device), scaled by `1 / (1 - p)`,
    drawn from the replicated stream of the communicator `comm_id`'s tracker (as a generator of its own: torch's
    default generator, which thread-ranks share, is not touched). A custom op so that a compiled graph calls it as
    it is (the tracker's lock and generator state are not traceable); seeded-nondeterministic, so a compiler never
    merges two draws nor recomputes one in the backward."""
    tracker = get_rng_tracker(lookup(comm_id))
    if DATA_PARALLEL_RNG not in tracker:
        raise ValueError(f"{where}: lora_dropout={p} under tensor parallelism draws one mask for all ranks from the "
                         f"RNG tracker's {DATA_PARALLEL_RNG!r} stream, which is not seeded on this rank; call "
                         f"tpkit.nn.model_parallel_manual_seed(seed, comm) (or tpkit.data_parallel_manual_seed) "
                         f"with the same seed on every rank before training, or use lora_dropout=0")
    with tracker.generator(DATA_PARALLEL_RNG, like.device) as g:
        mask = torch.empty(tuple(like.shape[:-1]) + (full,), dtype=like.dtype, device=like.device)
        mask.bernoulli_(1 - p, generator=g)
    return mask.div_(1 - p)


@_draw_mask.register_fake
def _(like, full, p, comm_id, where):
    return like.new_empty(tuple(like.shape[:-1]) + (full,))


def one_mask_dropout(x: torch.Tensor, p: float, comm: Communicator, where: str,
                     positions: Sequence[int] | None = None, full: int | None = None) -> torch.Tensor:
    """`x` dropped with probability `p` by this rank's part of one mask: the whole mask when `positions` is None
    (a replicated input), else the mask of the full input (`full` features in the last dim) at `positions`."""
    mask = _draw_mask(x.detach(), x.shape[-1] if positions is None else int(full), float(p), comm._comm_id, where)
    if positions is not None:
        mask = mask.index_select(-1, torch.tensor(tuple(positions), dtype=torch.long, device=x.device))
    return x * mask
