"""accelerate's `Accelerator` for a tensor-parallel model: the tp x cp ranks of one dp index are one data-parallel
replica (a tp group, when the model is not context-parallel).

transformers' Trainer does everything distributed through its accelerator: it shards the data loaders, wraps the
model in DDP, clips, gathers metrics. A stock accelerator sees one replica per process; this one sees one per
replica (`TrainLayout`), and changes only those four things:

- `prepare_data_loader`: accelerate's own sharding (`prepare_data_loader`, every argument the stock method passes)
  by the data-parallel rank over dp replicas, so every rank of a replica reads the same rows (a context-parallel
  model keeps its own tokens of them);
- `prepare_model`: autocast and `torch.compile` as accelerate applies them, and DDP over the dp group only
  (`tpkit.data_parallel`; FSDP2 was applied by the Trainer before the optimizer was made), never over the world;
- `clip_grad_norm_`: the global norm over every dimension (`tpkit.clip_grad_norm_`);
- `gather_for_metrics`: over the dp group (the ranks of a replica hold the same predictions), with accelerate's
  trimming of the last, padded batch (`gather_over_replicas`: without it); `no_sync`: `tpkit.no_sync` (DDP's or
  FSDP2's).

`gather` stays the world's: transformers divides what it gathers with it (the items of a batch) by the
tensor-parallel size it asks the Trainer for (the replica's tp x cp). Where a Trainer gathers predictions with
`gather` itself (`Seq2SeqTrainer`), the Trainer gives it `gather_over_replicas` instead (`base.py`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import recursively_apply

from ..data_parallel import data_parallel, data_parallel_of, no_sync
from ..nn.grad_clip import clip_grad_norm_
from .layout import TrainLayout


class TensorParallelAccelerator(Accelerator):
    """An `Accelerator` whose data-parallel replicas are those of `layout` (its tp x cp ranks of one dp index)."""

    def __init__(self, layout: TrainLayout, **kwargs: Any):
        super().__init__(**kwargs)
        self.train_layout = layout

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            if data_loader not in self._dataloaders:
                self._dataloaders.append(data_loader)
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement
        layout = self.train_layout
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=layout.dp_size, process_index=layout.dp_rank,
            split_batches=self.split_batches, put_on_device=device_placement, rng_types=self.rng_types.copy(),
            # every rank reads and shards (a dispatching rank 0 would split over the world's processes)
            dispatch_batches=False, even_batches=self.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=self.use_seedable_sampler, data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking, use_stateful_dataloader=self.use_stateful_dataloader)
        self._dataloaders.append(prepared)
        return prepared

    def prepare_model(self, model: torch.nn.Module, device_placement=None, evaluation_mode: bool = False):
        layout = self.train_layout
        if not evaluation_mode and layout.dp is not None and layout.dp_mode == "ddp" and \
                data_parallel_of(model) is None:
            handler = self.ddp_handler
            model = data_parallel(model, layout.dp, mode="ddp", **(handler.to_kwargs() if handler else {}))
            if handler is not None:
                handler.register_comm_hook(model)
        return super().prepare_model(model, device_placement, evaluation_mode=True)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        self.unscale_gradients()
        return clip_grad_norm_(list(parameters), max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self, model) -> Iterator[None]:
        with no_sync(model):
            yield

    def gather_over_replicas(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """What `Accelerator.gather` gives with one process per replica: every replica's data, over dp."""
        dp = self.train_layout.dp
        if dp is None:
            return input_data
        if use_gather_object or not _all_tensors(input_data):
            import torch.distributed as dist

            out: list = [None] * dp.world_size
            dist.all_gather_object(out, input_data, group=dp.process_group)
            return [x for part in out for x in (part if isinstance(part, list) else [part])]
        return recursively_apply(lambda t: dp.all_gather(t.reshape(1) if t.dim() == 0 else t.contiguous(), dim=0),
                                 input_data)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """What `Accelerator.gather_for_metrics` gives with one process per replica: gathered over dp, the samples
        the last batch repeated to fill every replica dropped."""
        data = self.gather_over_replicas(input_data, use_gather_object)
        state = self.gradient_state
        if not state.end_of_dataloader or state.remainder <= 0:
            return data
        try:  # as accelerate trims: a scalar (one replica's) has nothing to trim
            return data[:state.remainder] if isinstance(data, list) else \
                recursively_apply(lambda t: t[:state.remainder], data)
        except Exception:  # noqa: BLE001 - accelerate returns the data untrimmed whatever fails here
            return data


def _all_tensors(data: Any) -> bool:
    try:
        recursively_apply(lambda x: x, data, error_on_other_type=True)
        return True
    except TypeError:
        return False
