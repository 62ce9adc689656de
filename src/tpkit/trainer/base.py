"""`TensorParallelTrainer`: what a Hugging Face Trainer class needs to train a tensor-parallel model exactly.

A mixin placed before the stock class (`class Trainer(TensorParallelTrainer, transformers.Trainer)`), so that
transformers' and TRL's Trainers, and a user's subclass of them, take it the same way. Against the stock class it
changes:

- the accelerator: `TensorParallelAccelerator` (data loaders, DDP, clipping and metric gathers per data-parallel
  replica: the tp x cp ranks of one dp index are one replica), built with the arguments Trainer builds the stock one
  with;
- clipping and the logged norm: always the accelerator's `tpkit.clip_grad_norm_` (transformers computes a norm of
  its own when gradients live on several device meshes, as an expert-parallel model's plain expert gradients beside
  FSDP2's shards do, and would count each rank's experts as the whole model's);
- the tensor-parallel size Trainer asks for (`get_tp_size`: the replica's tp x cp, the divisor of the tokens it
  counts over the world, of the global batch and of its loss scale), and the input tokens it counts (once per
  replica);
- data parallelism: FSDP2 over the dp group when the arguments ask for fsdp (`tpkit.data_parallel`, applied before
  the optimizer is made), else DDP over it (the accelerator);
- saving and resuming (`checkpoints.py`): `save_model` writes one Hugging Face directory collectively,
  `checkpoint-N` holds a tpkit checkpoint beside Trainer's own state files;
- evaluation: `compute_metrics` sees the logits one process has: a compiled model's bare vocabulary slice gathered
  over tp, and a context-parallel model's tokens (each cp rank holds its zigzag share) gathered over cp into the
  whole sequences (`tpkit.gather_sequence`).

What cannot be exact is refused before training, naming why (`_check_arguments`, and `_check_experts` for an
expert-parallel model).
"""
from __future__ import annotations

import copy
import functools
import inspect
import os
from typing import Any

import torch

from ..context import gather_sequence
from ..convert.stock_calls import vocabulary_sizes
from ..data_parallel import data_parallel, repeated_blocks
from ..nn.record import find_record
from ..nn.split_logits import SplitLogits, gather_logits
from . import checkpoints
from .accelerator import TensorParallelAccelerator
from .layout import TrainerSetupError, layout_of



class TensorParallelTrainer:
    """Mixin for `transformers.Trainer` and its subclasses (see the module docstring). Takes the same arguments."""

    def __init__(self, model=None, args=None, *rest: Any, **kwargs: Any):
        if model is None:
            raise TrainerSetupError(f"{type(self).__name__}: pass the converted model (model_init is not supported: "
                                    f"each trial would need converting on every rank)")
        args, dp_mode, reshard = _check_arguments(args, kwargs, type(self).__name__)
        self.train_layout = layout_of(model, dp_mode)
        super().__init__(model, args, *rest, **kwargs)
        if getattr(self.accelerator.state, "fsdp_plugin", None) is not None or self.is_deepspeed_enabled:
            raise TrainerSetupError(f"{type(self).__name__}: accelerate is configured for FSDP or DeepSpeed (an "
                                    f"`accelerate launch` config?); tpkit.trainer runs data parallelism itself: "
                                    f"launch with torchrun and ask for FSDP with TrainingArguments(fsdp='full_shard')")
        layout = self.train_layout
        if layout.cp is not None and (self.label_smoother is not None or self.compute_loss_func is not None):
            raise TrainerSetupError(f"{type(self).__name__}: the model is context-parallel (each cp rank holds part of "
                                    f"every sequence's logits), and label smoothing or a compute_loss_func computes "
                                    f"the loss from the logits against whole labels; leave label_smoothing_factor at 0 "
                                    f"and compute_loss_func unset: the model's own loss is the whole sequences' mean")
        if layout.record.experts is not None:
            _check_experts(self, layout)
        if dp_mode == "fsdp" and layout.dp is not None:
            if self.optimizer is not None:
                raise TrainerSetupError(f"{type(self).__name__}: FSDP2 replaces the parameters, so an optimizer made "
                                        f"before the Trainer would hold stale ones; pass optimizer_cls_and_kwargs")
            inner = self.accelerator.unwrap_model(self.model)
            data_parallel(inner, layout.dp, mode="fsdp", blocks=repeated_blocks(inner),
                          reshard_after_forward=reshard)

    # ---------------------------------------------------------------------------------------- the accelerator

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        built = super()._build_accelerator_args(**kwargs)
        self._tpkit_accelerator_args = built
        return built

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator = TensorParallelAccelerator(self.train_layout, **self._tpkit_accelerator_args)
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(self.gather_function,
                                                     use_gather_object=self.args.eval_use_gather_object)

    def _has_mixed_mesh_grads(self, model) -> bool:
        """Never: transformers computes the norm of gradients on several device meshes itself (each mesh's norm, an
        expert-parallel model's plain expert gradients beside FSDP2's shards taken as whole), bypassing the
        accelerator; `TensorParallelAccelerator.clip_grad_norm_` counts every gradient once, whatever holds it."""
        return False

    def get_tp_size(self) -> int:
        """The ranks that see the same batch (tp x cp). Trainer divides by it what it counts over the world, and
        scales the loss by world / it before DDP averages over dp: a context-parallel model's loss is already the
        whole sequences' mean, so cp belongs here, not in `get_cp_size` (which stays 1: accelerate's own cp would
        scale each rank's share of the loss by dp x cp)."""
        return self.train_layout.replica_size

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """The labelled tokens the loss is divided by. transformers divides its count by `get_tp_size()` even when
        it did not gather it over the world (`average_tokens_across_devices=False`): this replica's own count is
        then put back (rounded: it is a whole number)."""
        count = super()._get_num_items_in_batch(batch_samples, device)
        if self.args.average_tokens_across_devices or not torch.is_tensor(count):
            return count
        return torch.round(count * self.train_layout.replica_size)

    def _track_num_input_tokens(self, inputs: Any) -> None:
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        added = self.state.num_input_tokens_seen - before  # the world's count: each replica's tokens tp x cp times
        self.state.num_input_tokens_seen = before + added // self.train_layout.replica_size

    def floating_point_ops(self, inputs: Any) -> int:
        """This rank's share of the step's operations (Trainer sums them over the world)."""
        return super().floating_point_ops(inputs) // self.train_layout.replica_size

    # ---------------------------------------------------------------------------------------- saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective. Inside a checkpoint save: a tpkit checkpoint (model and optimizer) in `output_dir`;
        otherwise one Hugging Face directory, as `save_pretrained` of the one-process model writes it."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if getattr(self, "_tpkit_saving_checkpoint", False):
            optimizer = None if self.args.save_only_model else self.optimizer
            checkpoints.save_checkpoint(self.model, output_dir, optimizer, self.state.global_step,
                                        self.train_layout.world)
            return
        self._save(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is not None:
            raise TrainerSetupError(f"{type(self).__name__}: saving a given state dict is not supported on a "
                                    f"tensor-parallel model (its tensors are this rank's slices)")
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        checkpoints.save_pretrained(model, output_dir, self.args.should_save)  # collective
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            elif getattr(getattr(self.data_collator, "tokenizer", None), "save_pretrained", None) is not None:
                self.data_collator.tokenizer.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        self.train_layout.world.barrier()

    def _save_checkpoint(self, model, trial) -> None:
        self._tpkit_saving_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._tpkit_saving_checkpoint = False

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.args.should_save:  # the optimizer is in the tpkit checkpoint save_model wrote
            checkpoints.save_scheduler(self.lr_scheduler, output_dir)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self.is_world_process_zero() and checkpoints.is_tpkit_checkpoint(checkpoint_folder):
            checkpoints.consolidated_files(checkpoint_folder, self.args.output_dir)
        super()._push_from_checkpoint(checkpoint_folder)

    # ---------------------------------------------------------------------------------------- resuming

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not checkpoints.is_tpkit_checkpoint(resume_from_checkpoint):
            raise TrainerSetupError(f"{resume_from_checkpoint}: no tpkit checkpoint there (tpkit.trainer writes one "
                                    f"into every checkpoint-N); to start from a Hugging Face model, load it with "
                                    f"tpkit.from_pretrained instead of resuming")
        checkpoints.load_checkpoint(model if model is not None else self.model, resume_from_checkpoint, None,
                                    self.train_layout.world)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if checkpoints.has_optimizer(checkpoint):
            checkpoints.load_checkpoint(self.model, checkpoint, self.optimizer, self.train_layout.world)
        scheduler = os.path.join(checkpoint, "scheduler.pt")
        if os.path.isfile(scheduler) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        checkpoints.load_checkpoint(self.model, self.state.best_model_checkpoint, None, self.train_layout.world)

    # ---------------------------------------------------------------------------------------- evaluation

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        if self.gather_function == self.accelerator.gather:  # Seq2SeqTrainer's choice: one process per replica's
            self.gather_function = self.accelerator.gather_over_replicas
        return super().evaluation_loop(*args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        return loss, self._full_logits(logits), labels

    def _full_logits(self, logits: Any) -> Any:
        """Logits as one process has them: a compiled model's bare vocabulary slice gathered over tp (a `SplitLogits`
        reads as full already), then a context-parallel model's local tokens gathered over cp (collective: every
        rank of a replica runs the same prediction steps on the same rows)."""
        if isinstance(logits, (tuple, list)):
            return type(logits)(self._full_logits(x) for x in logits)
        if not isinstance(logits, torch.Tensor):
            return logits
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        sizes = vocabulary_sizes(model)
        tp = self.train_layout.tp
        if sizes is not None and not isinstance(logits, SplitLogits) and logits.shape[-1] == sizes[tp.rank] and \
                sum(sizes) != sizes[tp.rank]:
            logits = gather_logits(logits, tp, sizes)
        context = self.train_layout.record.context
        if context is None or context.off or context.batch is None or logits.dim() < 2 or \
                logits.shape[1] != context.batch.split.local:
            return logits  # not per token of the last context-parallel forward (or cp switched off)
        return gather_sequence(logits, model)


def _check_experts(trainer, layout) -> None:
    """What an expert-parallel model cannot train exactly under a Trainer: raises `TrainerSetupError`."""
    who = type(trainer).__name__
    if layout.dp is not None and not trainer.accelerator.even_batches:
        raise TrainerSetupError(f"{who}: the model is expert-parallel (every rank of an expert group takes part in "
                                f"each MoE layer's all-to-all), and even_batches=False can give one data-parallel "
                                f"replica a batch fewer than another, which would wait for it forever; leave "
                                f"accelerator_config's even_batches at True")
    model = trainer.accelerator.unwrap_model(trainer.model)
    experts = layout.record.experts
    inner = model.get_submodule(find_record(model, "tpkit.trainer")[0])  # the converted model below PEFT's wrappers
    extra = [k for k, p in inner.named_parameters() if p.requires_grad and k not in experts.keys
             and any(k.startswith(m + ".") for m in experts.modules)]
    if extra:
        raise TrainerSetupError(f"{who}: {extra[0]} (of {len(extra)}) is trainable inside an expert-parallel experts "
                                f"module, which holds this rank's experts only: an adapter there would be each rank's "
                                f"own, averaged over dp as if it were one weight; put adapters outside the experts "
                                f"(PEFT target_modules such as q_proj / v_proj) or train the experts' own weights")
    text = model.config.get_text_config() if hasattr(getattr(model, "config", None), "get_text_config") else None
    if getattr(text, "output_router_logits", False) and (layout.dp is not None or layout.cp is not None):
        raise TrainerSetupError(f"{who}: output_router_logits=True adds the router's load-balancing loss, and "
                                f"tpkit.trainer does not make it the global batch's under "
                                f"{'context' if layout.cp is not None else 'data'} parallelism (Trainer's per-replica "
                                f"loss scaling is not checked against the global loss tpkit.expert_parallel computes); "
                                f"set output_router_logits=False in the model's config (TRL: router_aux_loss_coef=0.0), "
                                f"train without data or context parallelism (ep = tp), or train in a loop as "
                                f"examples/finetune.py does, where expert_parallel computes it over the global batch")


def _check_arguments(args, kwargs: dict, who: str):
    """`(a copy of args whose FSDP request tpkit runs itself, dp mode, FSDP2's reshard_after_forward)`; raises
    `TrainerSetupError` for what tpkit.trainer cannot train exactly."""
    from transformers import TrainingArguments

    args = args if args is not None else TrainingArguments(output_dir="tmp_trainer")
    if args.deepspeed:
        raise TrainerSetupError(f"{who}: DeepSpeed shards the model its own way; tpkit.trainer runs DDP or FSDP2 "
                                f"over the data-parallel ranks (TrainingArguments(fsdp='full_shard'))")
    if getattr(args, "parallelism_config", None) is not None:
        raise TrainerSetupError(f"{who}: parallelism_config is accelerate's own tensor / context parallelism; the "
                                f"model is split by tpkit already: leave it unset")
    if args.fp16:
        raise TrainerSetupError(f"{who}: fp16 loss scaling looks for overflows on each rank's own slices, so one rank "
                                f"could skip a step the others take; train in bf16 (bf16=True) instead")
    if getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        raise TrainerSetupError(f"{who}: train_sampling_strategy='batch_rebalance' shards by the world's ranks; use "
                                f"'random', 'sequential' or 'group_by_length'")
    plugin = args.fsdp_plugin_args  # what TrainingArguments made of fsdp= and fsdp_config (None: no FSDP)
    if plugin is None:
        return args, "ddp", True
    refused = {k: plugin.get(k) for k in ("cpu_offload", "activation_checkpointing") if plugin.get(k)}
    if int(plugin.get("fsdp_version", 2)) != 2:
        refused["version"] = plugin.get("fsdp_version")
    if refused:
        raise TrainerSetupError(f"{who}: FSDP settings {refused} are not supported on a tensor-parallel model: tpkit "
                                f"runs FSDP2 over the data-parallel ranks (fsdp='full_shard' or 'shard_grad_op'; "
                                f"gradient_checkpointing=True for recomputation)")
    args = copy.copy(args)
    args.fsdp_plugin_args = None  # tpkit applies FSDP2 itself; Trainer must not build accelerate's FSDP plugin
    return args, "fsdp", bool(plugin.get("reshard_after_forward", True))
