"""LoRA (Hugging Face PEFT) on a `VocabParallelEmbedding`: A split along the vocabulary like the base, B whole.

PEFT's embedding adapter adds `scaling * B(A[:, ids])` (A: `[r, vocab]`, B: `[dim, r]`). A rank holding the rows
`[start, end)` of the table keeps the same columns of A; it looks its ids up in both inside the base's forward
(`adapter=`), and the rows of ids outside its vocabulary are zeroed for the adapter as for the shard, so the
branch's result is a partial sum that joins the base's one all-reduce: no collective added. B multiplies each
rank's partial lookup, so its gradient is a sum over the ranks (summed where the branch reads it, as the row
linear layer's B is). A's gradient needs no sum: a column of A is read by the rank holding its row only.

Merging is PEFT's code on the local shard (`B @ A_columns` is the slice of `B @ A` the rank holds: exact). A
full-size A (a stock file, a one-process state dict) is cut to this rank's columns when loaded.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraConfig
from peft.tuners.lora.layer import Embedding as LoraEmbedding
from torch import nn

from .embedding import VocabParallelEmbedding
from .grad_sums import GradSum, sum_grads, summed
from .lora_checks import check_config


class VocabParallelLoraEmbedding(LoraEmbedding):
    """PEFT's `lora.Embedding` on a `VocabParallelEmbedding`: `lora_embedding_A` holds the base's vocabulary
    columns, `lora_embedding_B` is whole (gradient summed over the ranks)."""

    SPLIT = "lora_embedding_A"
    BASE = VocabParallelEmbedding

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0,
                 lora_alpha: int = 1, **kwargs: Any) -> None:
        check_config(config, kwargs.get("target_name") or type(base_layer).__name__)
        super().__init__(base_layer, adapter_name, config, r=r, lora_alpha=lora_alpha)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        """The full table's sizes: PEFT builds and initialises the adapter full size, then it is sliced."""
        return int(module.num_embeddings), int(module.embedding_dim)

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: LoraConfig, **kwargs: Any) -> None:
        check_config(config, kwargs.get("target_name") or type(self.get_base_layer()).__name__)
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        self.split_adapter(adapter_name)

    @property
    def comm(self):
        return self.get_base_layer().comm

    def _slice_positions(self) -> tuple[int, int, tuple[int, ...]]:
        """(dim of A split, the full vocabulary, this rank's vocabulary rows)."""
        base = self.get_base_layer()
        return 1, base.num_embeddings, tuple(range(base.vocab_start, base.vocab_end))

    def split_adapter(self, adapter_name: str) -> None:
        """Keep this rank's vocabulary columns of A (the base's rows) and sum B's gradient."""
        base = self.get_base_layer()
        _, full, positions = self._slice_positions()
        a = self.lora_embedding_A[adapter_name]
        if a.shape[1] == full and len(positions) != full:
            piece = nn.Parameter(a.detach()[:, positions[0]:positions[-1] + 1].clone(), requires_grad=a.requires_grad)
            self.lora_embedding_A[adapter_name] = piece
        sum_grads(self.lora_embedding_B, [adapter_name], base.comm)
        if not self.__dict__.get("_tp_takes_slices"):
            self.register_load_state_dict_pre_hook(_take_columns)
            self.__dict__["_tp_takes_slices"] = True

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise NotImplementedError(f"{type(self).__name__}: a mixed batch (adapter_names=) is not supported under "
                                      f"tensor parallelism; call set_adapter() per batch")
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if self.merged or not self._active():
            return self.base_layer(x, *args, **kwargs)
        return self.base_layer(x, *args, adapter=self._branch, **kwargs)

    def _active(self) -> list[str]:
        return [a for a in self.active_adapters if a in self.lora_embedding_A.keys()]

    def _branch(self, ids: torch.Tensor) -> torch.Tensor:
        """The active adapters' sum for `ids` as this rank's rows number them (the base zeroes the others)."""
        base = self.get_base_layer()
        pad = base.local_padding_idx if base.world_size > 1 else base.padding_idx
        out = None
        for name in self._active():
            a = self.lora_embedding_A[name]
            b = summed(self.lora_embedding_B._parameters[name], GradSum(), self.comm)
            d = (F.embedding(ids, a.T, pad) @ b.T) * self.scaling[name]
            out = d if out is None else out + d
        return out.to(base.weight.dtype)


def _take_columns(module: VocabParallelLoraEmbedding, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load pre-hook: a full-size A in `state_dict` (a stock PEFT file, a one-process state dict) is replaced by this
    rank's vocabulary columns, and a full base table (which PEFT saves with an embedding adapter) by its rows; a
    tensor already of the local size is left alone."""
    _, full, positions = module._slice_positions()
    start, stop = positions[0], positions[-1] + 1
    for key in [k for k in state_dict if k.startswith((f"{prefix}lora_embedding_A.", f"{prefix}base_layer.weight"))]:
        t, dim = state_dict[key], 0 if key.endswith("base_layer.weight") else 1
        if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[dim] == full != len(positions):
            state_dict[key] = t.narrow(dim, start, stop - start)
