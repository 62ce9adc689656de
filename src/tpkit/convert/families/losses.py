"""Losses a model computes itself, from logits the vocabulary family may keep split.

Hugging Face causal LMs compute their loss through `self.loss_function` (`ForCausalLMLoss`) from full logits;
with the head's logits kept split over the vocabulary (training mode), this family installs a drop-in that
shifts the labels the same way and calls `tpkit.nn.vocab_parallel_cross_entropy` (two small all-reduces per
step instead of gathering batch x seq x vocab logits). A model that computes its loss from full logits inline
(masked LM, seq2seq: `CrossEntropyLoss` over `view(-1, vocab)`) would be fed a slice: its head gathers its
logits in training too, with the reason.
"""
from __future__ import annotations

import inspect
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...nn import vocab_parallel_cross_entropy
from ..family import Checked, Choice, Draft, Family, Planned, Proposal
from ..styles import COLWISE_REP, VOCAB_PARALLEL


class VocabParallelCausalLMLoss:
    """Callable with the signature of HF's `ForCausalLMLoss`, on this rank's slice of the logits."""

    def __init__(self, comm, partition_sizes: Sequence[int]):
        self.comm = comm
        self.partition_sizes = tuple(int(s) for s in partition_sizes)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                 num_items_in_batch: torch.Tensor | None = None, ignore_index: int = -100,
                 shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
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


def computes_own_loss(model: nn.Module) -> bool:
    """A Hugging Face model whose forward computes its loss other than through `self.loss_function` as a causal
    LM (see the module docstring)."""
    if not isinstance(getattr(type(model), "loss_function", None), property):
        return False
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return True
    return "self.loss_function" not in source or getattr(model, "loss_type", None) not in (None, "ForCausalLM")


class ModelLosses(Family):
    name = "losses"

    def propose(self, draft: Draft, found) -> Iterator[Proposal]:
        """In training, a model computing its loss from full logits itself gets them gathered."""
        if draft.mode != "training" or not computes_own_loss(draft.analysis.model):
            return
        why = (f"logits gathered in training: {type(draft.analysis.model).__name__}.forward computes its loss from "
               f"full logits itself, which split logits would break")
        for h in [n for n, s in draft.entries.items() if s == VOCAB_PARALLEL]:
            yield Proposal(self.name, f"loss:{h}", (Choice("gathered logits", {h: COLWISE_REP}, reasons={h: why}),))

    def install(self, model: nn.Module, planned: Planned, checked: Checked | None, comm) -> None:
        """An HF causal LM whose head keeps split logits computes its loss with vocab_parallel_cross_entropy."""
        heads = [n for n, s in planned.styles.items() if s == VOCAB_PARALLEL]
        if comm.world_size > 1 and len(heads) == 1 and isinstance(getattr(type(model), "loss_function", None),
                                                                    property):
            model.loss_function = VocabParallelCausalLMLoss(comm, model.get_submodule(heads[0]).partition_sizes)
