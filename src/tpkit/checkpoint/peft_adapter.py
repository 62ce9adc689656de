"""Stock PEFT adapter files from and for a tensor-parallel model.

`PeftModel.save_pretrained(directory)`, called on every rank of a converted model, writes what one process of
PEFT writes: `adapter_config.json` and `adapter_model.safetensors` with stock keys and full-size tensors. Every
rank takes part in gathering the adapter's slices (`shard_layouts` says which part each holds); rank 0 writes,
into a temporary directory beside the target whose files are then renamed into place (a reader never sees half
a file), and every rank returns once the files are there. The tensors saved are the ones PEFT itself picks
(its selection is run on the local state dict, then only those are gathered), so a stock file results whatever
the config asks (`bias=`, `modules_to_save`, several adapters).

`PeftModel.from_pretrained(tp_model, directory)` and `load_adapter`: PEFT builds tpkit's LoRA layers through its
dispatch (`tpkit.nn.lora`), and each layer keeps its slice of the full tensors it is given; what else a stock file
holds at full size (a `modules_to_save` copy, split as its original) is sliced by its layout as it loads.

Both are installed into PEFT when tpkit converts a model in a process that imported PEFT, or by `lora_config`.
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
from typing import Any

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..convert.adapters import ON_PEFT, enable_peft
from ..convert.layouts import shard_layouts
from ..layout import ShardLayout
from ..nn._layer import TensorParallelModule


def lora_config(**kwargs: Any):
    """A `peft.LoraConfig(**kwargs)` that PEFT applies to tpkit's split layers (their LoRA layers registered in
    PEFT's custom-module dispatch), with PEFT's hooks for tensor-parallel models installed. Needed only when the
    config is used before tpkit converted a model in this process; a stock `LoraConfig` works after that."""
    from peft import LoraConfig

    enable_peft()
    from ..nn.lora import register

    return register(LoraConfig(**kwargs))


def _comm_of(model: nn.Module) -> Communicator | None:
    return next((m.comm for m in model.modules() if isinstance(m, TensorParallelModule)), None)


def gather_full(local: torch.Tensor, layout: ShardLayout, comm: Communicator) -> torch.Tensor:
    """The full tensor from every rank's slice (collective; a replicated tensor is returned as it is)."""
    if layout.is_replicated:
        return local
    numels = [layout.for_rank(r).local_numel for r in range(comm.world_size)]
    flat = local.detach().reshape(-1)
    gathered = comm.all_gather(flat, dim=0, sizes=numels)
    pieces, at = [], 0
    for r, n in enumerate(numels):
        pieces.append(gathered.narrow(0, at, n).reshape(layout.for_rank(r).local_shape))
        at += n
    return layout.unshard(pieces)


def adapter_state_dict(model: nn.Module, adapters: list[str], save_embedding_layers: Any = "auto",
                       comm: Communicator | None = None) -> dict[str, torch.Tensor]:
    """`{model state_dict key: full tensor}` of what PEFT saves for `adapters` (collective)."""
    from peft.utils import get_peft_model_state_dict

    local = model.state_dict()
    key_of = {id(v): k for k, v in local.items()}
    keys: dict[str, None] = {}
    for adapter in adapters:
        picked = get_peft_model_state_dict(model, state_dict=local, adapter_name=adapter,
                                           save_embedding_layers=save_embedding_layers)
        for saved, t in picked.items():
            if id(t) not in key_of:
                raise ValueError(f"save_pretrained: PEFT saves {saved!r} as a tensor the model's state dict does not "
                                 f"hold; tpkit cannot tell which part of it this rank holds")
            keys[key_of[id(t)]] = None
    layouts = shard_layouts(model)
    comm = comm or _comm_of(model)
    return {k: gather_full(local[k], layouts[k], comm) for k in local if k in keys}


def _move_into(src: str, dst: str) -> None:
    """Every file under `src` renamed to the same place under `dst` (each replaced atomically)."""
    for root, _, files in os.walk(src):
        target = os.path.join(dst, os.path.relpath(root, src))
        os.makedirs(target, exist_ok=True)
        for f in files:
            os.replace(os.path.join(root, f), os.path.join(target, f))


def _full_to_local(layouts: dict[str, ShardLayout]):
    """A load pre-hook for a whole model: each full-size tensor of a split key is replaced by this rank's slice."""
    def hook(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        for key, t in list(state_dict.items()):
            lay = layouts.get(key[len(prefix):]) if key.startswith(prefix) else None
            if lay is not None and not lay.is_replicated and isinstance(t, torch.Tensor) and \
                    tuple(t.shape) == tuple(lay.full_shape) != tuple(lay.local_shape):
                state_dict[key] = lay.shard(t)
    return hook


@functools.lru_cache(maxsize=None)
def install_loading() -> None:
    """Wrap PEFT's `set_peft_model_state_dict` (what `from_pretrained` / `load_adapter` load through) so a stock
    file's full-size tensors load onto a tensor-parallel model as each rank's slices, whatever module holds them (a
    `modules_to_save` copy split as its original included; the LoRA layers also cut their own factors)."""
    import peft.peft_model as peft_model

    original = peft_model.set_peft_model_state_dict

    @functools.wraps(original)
    def set_peft_model_state_dict(model, *args: Any, **kwargs: Any):
        comm = _comm_of(model)
        if comm is None or comm.world_size == 1:
            return original(model, *args, **kwargs)
        handle = model.register_load_state_dict_pre_hook(_full_to_local(shard_layouts(model)))
        try:
            return original(model, *args, **kwargs)
        finally:
            handle.remove()

    set_peft_model_state_dict.tpkit_original = original  # type: ignore[attr-defined]
    peft_model.set_peft_model_state_dict = set_peft_model_state_dict


@functools.lru_cache(maxsize=None)
def install() -> None:
    """Wrap `PeftModel.save_pretrained` so a tensor-parallel model writes stock full-size files (idempotent; a
    model without tpkit layers, or at world size 1, saves exactly as before)."""
    from peft import PeftModel

    original = PeftModel.save_pretrained

    @functools.wraps(original)
    def save_pretrained(self, save_directory: str, *args: Any, **kwargs: Any) -> None:
        comm = _comm_of(self)
        if comm is None or comm.world_size == 1 or "state_dict" in kwargs or args:
            return original(self, save_directory, *args, **kwargs)
        adapters = kwargs.get("selected_adapters") or list(self.peft_config)
        full = adapter_state_dict(self, adapters, kwargs.get("save_embedding_layers", "auto"), comm)
        if comm.rank == 0 and kwargs.get("is_main_process", True):
            parent = os.path.dirname(os.path.abspath(save_directory)) or "."
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(save_directory)}.tmp-")
            try:
                original(self, tmp, state_dict=full, **kwargs)
                _move_into(tmp, save_directory)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        comm.barrier()

    save_pretrained.tpkit_original = original  # type: ignore[attr-defined]
    PeftModel.save_pretrained = save_pretrained


ON_PEFT.append(install)
ON_PEFT.append(install_loading)
