"""The causal-LM loss on vocabulary-split logits, for models whose LM head is planned `vocab_parallel`.

Hugging Face models compute their loss from full logits (`ForCausalLMLoss`); with the head's logits kept
split over the vocabulary (training mode), `parallelize` installs this drop-in instead, which shifts the
labels the same way and calls `tpkit.nn.vocab_parallel_cross_entropy` (two small all-reduces per step
instead of gathering batch x seq x vocab logits).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


class VocabParallelCausalLMLoss:
    """Callable with the signature of HF's `ForCausalLMLoss`, on this rank's slice of the logits."""

    def __init__(self, comm, partition_sizes: Sequence[int]):
        self.comm = comm
        self.partition_sizes = tuple(int(s) for s in partition_sizes)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                 num_items_in_batch: torch.Tensor | None = None, ignore_index: int = -100,
                 shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        from ..nn import vocab_parallel_cross_entropy

        logits = logits.float()
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.reshape(-1).to(logits.device)
        logits = logits.reshape(-1, logits.shape[-1])
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = vocab_parallel_cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction,
                                            comm=self.comm, partition_sizes=self.partition_sizes)
        if reduction == "sum":
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss
