"""Hugging Face `Trainer` and TRL `SFTTrainer` for tensor-parallel models: the one change in a user's script is the
import.

    comm = tpkit.init()                                   # torchrun --nproc-per-node 4 train.py
    tp, dp = tpkit.comm.split(comm, 2)                    # tp2 x dp2 (or convert on comm itself: tp = world)
    model = tpkit.from_pretrained(path, comm=tp, mode="training")
    trainer = tpkit.trainer.Trainer(model=model, args=TrainingArguments(...), train_dataset=...)
    trainer.train(); trainer.save_model()                 # a Hugging Face directory, as one process writes it

A context-parallel model (cp x tp) takes the same call, its groups made by `tpkit.comm.groups`:

    g = tpkit.comm.groups(comm, tp=2, cp=2)               # tp2 x cp2 (x dp = world / 4)
    model = tpkit.context_parallel(tpkit.from_pretrained(path, comm=g.tp, mode="training"), g.cp)

and so does an expert-parallel MoE (`tpkit.expert_parallel`; its experts reduce their own gradients, DDP / FSDP2 leave
them alone, `save_model` gathers each from the rank holding it):

    g = tpkit.comm.groups(comm, tp=2, ep=4)               # tp2 x dp2, the experts spread over the 4 ranks
    model = tpkit.expert_parallel(tpkit.from_pretrained(path, comm=g.tp, mode="training",
                                                        plan=tpkit.KEEP_EXPERTS_WHOLE), g)

The tensor-parallel (and context-parallel) groups are the model's; the rest of the world is data parallel
(`layout.py`): the tp x cp ranks of one dp index are one replica that reads `per_device_train_batch_size` rows
(whole sequences: each cp rank keeps its tokens), gradients are averaged over dp (DDP, or FSDP2 when the arguments
ask for fsdp; the model sums them over cp itself), clipping uses the global norm, and metrics are gathered over dp
(a cp model's logits gathered into whole sequences first). `Trainer` and
`Seq2SeqTrainer` are transformers' classes with `TensorParallelTrainer` (`base.py`) in front; `SFTTrainer`
(`sft.py`) is TRL's, imported only when used (the `trl` extra).
"""
from __future__ import annotations

from typing import Any

import transformers

from .base import TensorParallelTrainer
from .layout import TrainerSetupError, TrainLayout, layout_of


class Trainer(TensorParallelTrainer, transformers.Trainer):
    """`transformers.Trainer` for a model tpkit converted (`from_pretrained`, `parallelize`, a PEFT model of
    either); same arguments."""


class Seq2SeqTrainer(TensorParallelTrainer, transformers.Seq2SeqTrainer):
    """`transformers.Seq2SeqTrainer` (`predict_with_generate` included) for a model tpkit converted."""


def __getattr__(name: str) -> Any:
    if name == "SFTTrainer":  # TRL only when asked for
        from .sft import SFTTrainer

        return SFTTrainer
    raise AttributeError(f"module 'tpkit.trainer' has no attribute {name!r}")


__all__ = ["SFTTrainer", "Seq2SeqTrainer", "TensorParallelTrainer", "Trainer", "TrainerSetupError", "TrainLayout",
           "layout_of"]
