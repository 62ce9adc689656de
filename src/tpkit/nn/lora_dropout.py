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
from .random import DATA_PARALLEL_RNG, get_rng_tracker


def one_mask_dropout(x: torch.Tensor, p: float, comm: Communicator, where: str,
                     positions: Sequence[int] | None = None, full: int | None = None) -> torch.Tensor:
    """`x` dropped with probability `p` by this rank's part of one mask: the whole mask when `positions` is None
    (a replicated input), else the mask of the full input (`full` features in the last dim) at `positions`."""
    tracker = get_rng_tracker(comm)
    if DATA_PARALLEL_RNG not in tracker:
        raise ValueError(f"{where}: lora_dropout={p} under tensor parallelism draws one mask for all ranks from the "
                         f"RNG tracker's {DATA_PARALLEL_RNG!r} stream, which is not seeded on this rank; call "
                         f"tpkit.nn.model_parallel_manual_seed(seed, comm) (or tpkit.data_parallel_manual_seed) "
                         f"with the same seed on every rank before training, or use lora_dropout=0")
    shape = tuple(x.shape) if positions is None else tuple(x.shape[:-1]) + (int(full),)
    with tracker.fork(DATA_PARALLEL_RNG):
        mask = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    mask.div_(1 - p)
    if positions is not None:
        mask = mask.index_select(-1, torch.tensor(tuple(positions), dtype=torch.long, device=x.device))
    return x * mask
