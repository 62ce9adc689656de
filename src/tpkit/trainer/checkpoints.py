"""What `tpkit.trainer` writes and reads: one Hugging Face directory for `save_model`, tpkit's per-shard layout for
`checkpoint-N`.

`save_model()` (collective) writes what `save_pretrained` of the one-process model writes, through the converted
model's own `save_pretrained` (every full tensor gathered, world rank 0 writing: `convert/stock_calls.py`; a PEFT
model's stock adapter files: `convert/peft/seam.py`), then the processing class and the training arguments, as
Trainer does; nothing else in the directory is touched.

`checkpoint-N` holds `tpkit.save_sharded`'s versioned directory (model and optimizer, safetensors; any TP or DP size
resumes it) beside the small files Trainer itself writes and reads there (`trainer_state.json`, the scheduler,
every rank's RNG state). `resume_from_checkpoint` loads the model and the optimizer back with `tpkit.load_sharded`.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch
from torch import nn

from ..checkpoint import consolidate, load_sharded, save_sharded
from ..checkpoint.manifest import find_version, read_manifest
from ..comm.communicator import Communicator
from ..data_parallel import data_parallel_of
from ..nn.full_tensors import tp_local
from ..nn.record import find_record

#: The files of a Hugging Face model directory `_push_from_checkpoint` copies next to the pushed output.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def save_pretrained(model: nn.Module, directory: str, is_main_process: bool) -> None:
    """`model.save_pretrained(directory)` on every rank (collective): the directory one process writes. A model tpkit
    split over tp answers through its own save hooks (`convert/stock_calls.py`); one that is not split over tp (only
    context-parallel) but sharded by FSDP2 over dp has its shards made whole here first, over dp, since transformers
    would write FSDP2's shards as they are."""
    found = find_record(model, "save_model")
    dp = data_parallel_of(model)
    if found is None or found[1].world_size > 1 or dp is None or dp.mode != "fsdp":
        model.save_pretrained(directory, is_main_process=is_main_process)
        return
    dp.reshard()
    state = {key: tp_local(t).detach().cpu() for key, t in model.state_dict().items()}  # every rank, in one order
    model.save_pretrained(directory, state_dict=state, is_main_process=is_main_process)


def inner_optimizer(optimizer):
    """The torch optimizer inside accelerate's `AcceleratedOptimizer` (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def save_checkpoint(model: nn.Module, directory: str, optimizer, step: int, world: Communicator) -> str:
    """Model (and optimizer, unless None) as a tpkit checkpoint under `directory` (collective over `world`)."""
    return save_sharded(model, directory, optimizer=None if optimizer is None else inner_optimizer(optimizer),
                        step=step, comm=world)


def has_optimizer(directory: str) -> bool:
    """Whether the tpkit checkpoint under `directory` holds optimizer state (not one saved with save_only_model)."""
    version = find_version(directory)
    return version is not None and bool(read_manifest(version).get("optimizer"))


def load_checkpoint(model: nn.Module, directory: str, optimizer, world: Communicator) -> dict:
    """Load a `save_checkpoint` directory into `model` (and `optimizer`), any TP / DP size (collective)."""
    return load_sharded(model, directory, optimizer=None if optimizer is None else inner_optimizer(optimizer),
                        comm=world)


def is_tpkit_checkpoint(directory: str) -> bool:
    return os.path.isdir(directory) and find_version(directory) is not None


def consolidated_files(checkpoint: str, output_dir: str) -> list[str]:
    """Write the Hugging Face model of the tpkit `checkpoint` into `output_dir` (one process: no collective), the
    model files only; returns their names."""
    tmp = tempfile.mkdtemp(dir=output_dir, prefix=".tpkit-consolidate-")
    try:
        consolidate(checkpoint, os.path.join(tmp, "model"), tokenizer=None, progress=False)
        names = []
        for name in sorted(os.listdir(os.path.join(tmp, "model"))):
            if name in MODEL_FILES or name.startswith("model-") and name.endswith(".safetensors"):
                os.replace(os.path.join(tmp, "model", name), os.path.join(output_dir, name))
                names.append(name)
        return names
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_scheduler(scheduler, directory: str) -> None:
    """The learning-rate scheduler's state, as Trainer writes it (`scheduler.pt`)."""
    if scheduler is not None:
        torch.save(scheduler.state_dict(), os.path.join(directory, "scheduler.pt"))
