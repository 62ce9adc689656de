"""Context parallelism inside a pipeline stage: the stage, not the model's forward hook, cuts each forward's inputs.

`tpkit.context_parallel` makes a model take WHOLE sequences: a pre-hook on its forward keeps this rank's zigzag
tokens and sets the forward's `ContextBatch`, which every attention layer reads. A pipeline stage (`tpkit.pipeline`)
runs the model's own forward too, but only the first stage is given token ids; a later stage is given the hidden
states the stage before sent it, which are this rank's tokens already (cut again, they would be wrong), and from
them alone it could not know the tokens' global positions (rotary) nor the split. So in a pipeline every stage is
also handed the micro-batch's whole token ids (every rank is given the same batch, as every cp rank of a whole
model is) and cuts them the same way (`StageContext.inputs`): the first stage's ids, every stage's global
positions, and the `ContextBatch` of the forward; the model's own hooks pass through meanwhile (`caller_cuts`).

The loss is computed on the last stage from its logits of this rank's tokens (`token_mean`): the labels shifted over
the whole sequence before the cut (the label of a rank's last token in a chunk is the next chunk's first token,
which another rank holds), each rank's share of the sum divided by the whole micro-batch's count of labelled
tokens, and the shares summed over cp (all-reduce forward, identity backward: each rank's gradient is that of its
own tokens). Every cp rank then holds the micro-batch's global token mean, as `model(input_ids=x, labels=x).loss`
computes it in one process. The weights' gradients are summed over cp by `context_parallel`'s rewrites, as for a
whole model.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..nn.mappings import reduce_from_region
from .apply import context_of
from .batch import IGNORE, shard_inputs
from .sequence import SequenceSplit


class StageContext:
    """What a pipeline stage of a context-parallel model (`context_parallel` applied to the rank's part) does around
    each forward: cut the micro-batch's whole token ids, and keep the model's own hooks from cutting again."""

    def __init__(self, model: nn.Module):
        self.state = context_of(model)

    @property
    def comm(self) -> Communicator:
        return self.state.comm

    def inputs(self, tokens: torch.Tensor | None, hidden: torch.Tensor | None = None) -> dict[str, Any]:
        """The model forward's keyword arguments for this rank's tokens of the micro-batch `tokens` (its whole token
        ids, [rows, length]): its ids cut (the first stage), or `hidden` (this rank's hidden states, sent by the stage
        before) as `inputs_embeds`; global `position_ids`. Sets the forward's `ContextBatch` the attention reads."""
        if tokens is None or tokens.dim() != 2:
            got = "none" if tokens is None else f"shape {tuple(tokens.shape)}"
            raise ValueError(f"context-parallel pipeline stage: it needs the micro-batch's whole token ids [rows, "
                             f"length] (got {got}) to cut them over cp {self.comm.world_size}; Pipeline.step and "
                             f"Pipeline.eval hand them to every stage (call those, not the stage module)")
        kwargs, batch = shard_inputs({"input_ids": tokens}, self.comm.rank, self.comm.world_size)
        if hidden is not None:
            ids = kwargs.pop("input_ids")
            if tuple(hidden.shape[:2]) != tuple(ids.shape):
                raise ValueError(f"context-parallel pipeline stage: hidden states of shape {tuple(hidden.shape)} "
                                 f"arrived, but this rank's share of {tuple(tokens.shape)} token ids over cp "
                                 f"{self.comm.world_size} is {tuple(ids.shape)} tokens; every rank of the pipeline "
                                 f"must be given the same batch")
            kwargs["inputs_embeds"] = hidden
        self.state.batch = batch
        return kwargs

    @contextlib.contextmanager
    def caller_cuts(self) -> Iterator[None]:
        """The model's own context-parallel hooks pass through inside the block: the inputs are cut already
        (`inputs`), and the loss is summed over cp by `token_mean`, not by the model's forward."""
        before, self.state.off = self.state.off, True
        try:
            yield
        finally:
            self.state.off = before


def local_labels(labels: torch.Tensor, comm: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
    """`(this rank's shifted labels, the count of labelled tokens of the whole batch)` of whole-sequence `labels`
    [rows, length]: shifted over the whole sequence first (the last position gets no label), then cut as the
    tokens are (pads ignored)."""
    split = SequenceSplit(labels.shape[1], comm.world_size)
    shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE)], dim=1)
    return split.split(shifted, 1, comm.rank, IGNORE), (shifted != IGNORE).sum()


def token_mean(loss_function: Callable[..., torch.Tensor], logits: torch.Tensor, labels: torch.Tensor,
               vocab_size: int, comm: Communicator) -> torch.Tensor:
    """The token mean of the whole micro-batch's loss (on every rank of `comm`, the cp group) from this rank's
    `logits` [rows, local tokens, vocab] and the whole sequences' `labels`; `loss_function` has the signature of
    Hugging Face's `ForCausalLMLoss` (tpkit's vocabulary-parallel one under tensor parallelism)."""
    shifted, count = local_labels(labels, comm)
    if logits.shape[:2] != shifted.shape:
        raise ValueError(f"context-parallel loss: logits of shape {tuple(logits.shape)} for labels of shape "
                         f"{tuple(labels.shape)}, whose share over cp {comm.world_size} is {tuple(shifted.shape)} "
                         f"tokens; the logits must be this rank's tokens of the same micro-batch")
    share = loss_function(logits=logits, labels=None, vocab_size=vocab_size, shift_labels=shifted,
                          num_items_in_batch=count)
    return reduce_from_region(share, comm)
