"""TRL's `SFTTrainer` for a tensor-parallel model: its loss and metrics over the split vocabulary.

TRL computes its loss without the model's LM-head forward: its fused head (`trl.trainer.utils.add_fused_lm_head`)
multiplies the hidden states by `lm_head.weight` itself and derives each token's log-probability, the entropy and
whether the label is the top token. On a converted model that weight is this rank's slice of the vocabulary (or of
the head's outputs), so each of the three is computed over part of the vocabulary, silently.

`SFTTrainer` puts back, in the same place and with the same protocol (`model(..., fused_lm_head=True)` returns
TRL's `FusedCausalLMOutput`), a head that runs the model's own tensor-parallel LM head: its logits (this rank's
vocabulary slice in training mode, the full logits in inference mode) are scaled, soft-capped and divided by the
temperature as TRL's kernel does, in float32 as TRL's kernel computes, and the log-probabilities come from
`vocab_parallel_cross_entropy`, the entropy and top-1 flags from `vocab_parallel_statistics` (a few all-reduces of
per-token statistics; the full logits are never gathered). The rest is TRL's own `compute_loss`, with the
`TensorParallelTrainer` changes every Trainer gets (`base.py`). Tested with TRL `TESTED_TRL`.

A context-parallel model (`tpkit.context_parallel`) holds each sequence's tokens split over its cp ranks, but TRL
sums the returned per-token tensors itself (the loss, the token accuracy, the entropy): the head returns them for the
whole sequences, gathered over cp (`tpkit.gather_sequence`, differentiable: each rank's backward keeps its own
tokens' gradient, which the model sums over cp), so every cp rank computes one process's figures.
"""
from __future__ import annotations

import functools
import types
from typing import Any

import torch
import trl
from trl.trainer.utils import FusedCausalLMOutput

from ..context import gather_sequence
from ..nn.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_statistics
from ..nn.record import communicator_of, record_of
from .base import TensorParallelTrainer
from .layout import TrainerSetupError

TESTED_TRL = ("1.16",)  # the release series the head and its protocol were written against (pyproject's trl extra)


class SFTTrainer(TensorParallelTrainer, trl.SFTTrainer):
    """TRL's `SFTTrainer` for a model tpkit converted; same arguments (`SFTConfig`)."""

    def __init__(self, model=None, args=None, *rest: Any, **kwargs: Any):
        version = getattr(trl, "__version__", "?")
        if not any(version == s or version.startswith(s + ".") for s in TESTED_TRL):
            raise TrainerSetupError(f"tpkit.trainer.SFTTrainer was tested with TRL {', '.join(TESTED_TRL)}.x; this "
                                    f"process has TRL {version}, whose fused LM head may differ: install "
                                    f"'tpkit[trl]'")
        if isinstance(model, str):
            raise TrainerSetupError("tpkit.trainer.SFTTrainer: pass the converted model, not a name (TRL would load "
                                    "it on one process): tpkit.from_pretrained(path, comm=tp, mode='training')")
        super().__init__(model, args, *rest, **kwargs)
        if self.aux_loss_enabled:
            raise TrainerSetupError("tpkit.trainer.SFTTrainer: the MoE load-balancing loss (router_aux_loss_coef) is "
                                    "computed by TRL's head from router logits tpkit does not gather; set "
                                    "router_aux_loss_coef=0.0")
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        base.forward = types.MethodType(_split_vocabulary_head(base), base)


def _split_vocabulary_head(model: torch.nn.Module):
    """The forward TRL's `add_fused_lm_head` gives `model`, for an LM head split over the ranks."""
    text = model.config.get_text_config()
    softcap = getattr(text, "final_logit_softcapping", None)
    scale = _logit_scale(text)
    comm = communicator_of(model)
    original = type(model).forward

    @functools.wraps(original)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            extra = {k: v for k, v in (("labels", labels), ("shift_labels", shift_labels),
                                       ("num_items_in_batch", num_items_in_batch)) if v is not None}
            return original(self, *args, **kwargs, **extra)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = self.get_output_embeddings()
        mask = labels != -100
        z = head(hidden).float() * scale  # TRL's kernel: float32, scale, soft cap
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        target = labels.clamp(min=0)
        sizes = tuple(getattr(head, "partition_sizes", ())) if z.shape[-1] != self.config.vocab_size else None
        log_probs = -vocab_parallel_cross_entropy(z, target, reduction="none", comm=comm if sizes else _one(),
                                                  partition_sizes=sizes or None)
        entropy, is_top1 = vocab_parallel_statistics(z, target, comm if sizes else _one(), partition_sizes=sizes)
        log_probs, entropy, is_top1 = (t.masked_fill(~mask, 0) for t in (log_probs, entropy, is_top1))
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        context = getattr(record_of(self), "context", None)
        if context is not None and not context.off:  # the cp ranks' tokens, for TRL's sums
            log_probs, entropy, is_top1, mask = _whole_sequences(self, log_probs, entropy, is_top1, mask)
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, is_top1=is_top1, label_mask=mask)

    return forward


def _whole_sequences(model: torch.nn.Module, log_probs: torch.Tensor, entropy: torch.Tensor, is_top1: torch.Tensor,
                     mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The per-token tensors of a context-parallel forward over the whole sequences (one gather over cp; the labels
    were shifted over the whole sequence, its last position ignored). The model's own `loss` stays this rank's share,
    which the model sums over cp itself."""
    stacked = torch.stack([log_probs, entropy.to(log_probs.dtype), is_top1.to(log_probs.dtype),
                           mask.to(log_probs.dtype)])
    whole = gather_sequence(stacked, model, dim=2)
    return whole[0], whole[1], whole[2].to(is_top1.dtype), whole[3].to(mask.dtype)


def _logit_scale(text_config) -> float:
    """The multiplier TRL's fused head applies to the logits (its reading of the config, `add_fused_lm_head`)."""
    scale = getattr(text_config, "logit_scale", None)
    for name in ("output_multiplier", "lm_head_multiplier"):
        scale = getattr(text_config, name, None) if scale is None else scale
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        s = text_config.logits_scaling
        scale = s if text_config.model_type == "hyperclovax" else 1 / s
    return 1.0 if scale is None else scale


@functools.lru_cache(maxsize=1)
def _one():
    """A world of one: the statistics of logits that are whole on every rank need no communication."""
    from ..comm.context import world_of_one

    return world_of_one()
