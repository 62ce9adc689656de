"""One forward's inputs cut over the cp group, and what the attention needs to mask them exactly.

The context-parallel model takes WHOLE sequences on every cp rank (`input_ids` and the rest are small integer
tensors; Megatron's data path also hands every cp rank the whole batch and slices it) and keeps only its zigzag
tokens (`sequence.py`). Everything that must see the whole sequence is done here, before the cut:

- `position_ids` are global: the model's rotary embedding sees each token's true position;
- labels are shifted over the whole sequence (`shift_labels`: the label of a rank's last token is the first token
  of the next chunk, which another rank holds), padded positions get -100, and the loss is normalised by the count
  of labelled tokens of the whole batch (`num_items_in_batch`), so that summing the ranks' losses gives the global
  token mean;
- the attention mask: Hugging Face builds none for a custom attention name, so the padding mask (a 2-D
  `attention_mask`) and packed documents (`position_ids` restarting, as HF detects them) become per-token `keep`
  and `docs` rows that the attention turns into each block's mask (`ContextBatch.allowed`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .sequence import SequenceSplit

IGNORE = -100


@dataclasses.dataclass(frozen=True)
class ContextBatch:
    """The sequence split of one forward and the masks' inputs over the whole (padded) sequence.

    `docs`: [batch, padded] document number of each token (None: one document per row); `keep`: [batch, padded]
    False at padding (None: no padding). A key is visible to a query when causal, in its document, kept and (on a
    sliding-window layer) within the window. A query that sees no key at all (a left-padded row's pads) gets a
    zero output, as torch's sdpa gives a fully masked row: what Hugging Face's sdpa models compute in one process
    (their last pad position's prediction of the first real token is in the loss)."""

    split: SequenceSplit
    rank: int
    docs: torch.Tensor | None = None
    keep: torch.Tensor | None = None

    @property
    def masked(self) -> bool:
        return self.docs is not None or self.keep is not None

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """[batch or 1, 1, len(q_pos), len(k_pos)] bool: which keys each query may see (global positions); with a
        sliding `window`, only the last `window` positions (Hugging Face's rule: q - k < window)."""
        ok = (k_pos[None, :] <= q_pos[:, None])[None, None]
        if window is not None:
            ok = ok & (q_pos[:, None] - k_pos[None, :] < window)[None, None]
        if self.docs is not None:
            ok = ok & (self.docs[:, q_pos][:, None, :, None] == self.docs[:, k_pos][:, None, None, :])
        if self.keep is not None:
            ok = ok & self.keep[:, k_pos][:, None, None, :]
        return ok


def _documents(position_ids: torch.Tensor) -> torch.Tensor:
    """Document numbers of packed rows: a new document wherever the position does not follow the previous one."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, dim=-1, prepend=first) != 1).cumsum(-1)


def _trivial(t: torch.Tensor | None, expected) -> bool:
    """Whether `t` says nothing (None, or equal to `expected`): checked eagerly only, once per forward, outside any
    compiled region (as Hugging Face skips an all-ones mask); a compiled forward keeps the mask."""
    if t is None:
        return True
    if torch.compiler.is_compiling():
        return False
    return bool((t == expected).all())


def shard_inputs(kwargs: dict[str, Any], rank: int, cp: int) -> tuple[dict[str, Any], ContextBatch]:
    """This rank's inputs (whole sequences in, zigzag tokens out) and the forward's `ContextBatch`."""
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    whole = ids if ids is not None else embeds
    if whole is None or whole.dim() < 2:
        raise ValueError("context parallelism: the model needs input_ids or inputs_embeds of shape [batch, sequence, "
                         "...] (whole sequences: each cp rank keeps its own tokens)")
    rows, length = whole.shape[0], whole.shape[1]
    split = SequenceSplit(length, cp)
    device = whole.device
    out = dict(kwargs)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise ValueError(f"context parallelism: attention_mask of shape {tuple(mask.shape)}; it takes the 2-D padding "
                         f"mask [batch, sequence] (custom 4-D masks cannot be cut over the sequence)")
    natural = torch.arange(length, device=device).expand(rows, length)
    positions = kwargs.get("position_ids")
    positions = natural if positions is None else positions.expand(rows, length)
    # documents as Hugging Face finds them: from restarting positions, only when no attention_mask is given
    docs = None if mask is not None or _trivial(positions, natural) else \
        split.padded_tensor(_documents(positions), 1, -1)
    keep = None if _trivial(mask, 1) else split.padded_tensor(mask.bool(), 1, False)
    tail = positions[:, -1:] + 1 + torch.arange(split.pad, device=device)
    out["position_ids"] = split.take(torch.cat([positions, tail], 1), 1, rank)
    out["attention_mask"] = None
    if ids is not None:
        out["input_ids"] = split.split(ids, 1, rank)
    if embeds is not None:
        out["inputs_embeds"] = split.split(embeds, 1, rank)
    labels, shifted = kwargs.get("labels"), kwargs.get("shift_labels")
    if labels is not None or shifted is not None:
        if shifted is None:
            shifted = torch.cat([labels[:, 1:], labels.new_full((rows, 1), IGNORE)], dim=1)
        if kwargs.get("num_items_in_batch") is None:
            out["num_items_in_batch"] = (shifted != IGNORE).sum()
        out["shift_labels"] = out["labels"] = split.split(shifted, 1, rank, IGNORE)
    out["use_cache"] = False
    return out, ContextBatch(split, rank, docs, keep)
