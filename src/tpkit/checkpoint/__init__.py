"""Checkpoints: Hugging Face and tpkit files in and out, each rank reading and writing only its slices.

`from_pretrained` (pretrained.py) builds a model for this rank from a Hugging Face directory or a tpkit
checkpoint; `save_sharded` (save.py) and `load_sharded` (load.py) write and read tpkit checkpoints whose
layout does not depend on the TP size; `Checkpointer` (checkpointer.py) saves a training run every N steps and
resumes it after a restart; `consolidate` (consolidate.py) turns one back into a Hugging Face
directory. Underneath: the safetensors format (safetensors_file.py), where each full tensor's pieces live
(sources.py), which bytes fill which part of a rank's region (reader.py), several reads in flight and each
target finished in order (fill.py), host -> device staging through reused pinned buffers (staging.py), memory
for a model built on the meta device (allocate.py), the directory and manifest (manifest.py), optimizer state
(optimizer.py), cross-rank agreement on errors (agree.py) and progress (progress.py). Which slice a rank holds
always comes from `ShardLayout`s.
"""
from __future__ import annotations

from .checkpointer import Checkpointer
from .consolidate import consolidate
from .errors import CheckpointError
from .load import load_sharded
from .pretrained import from_pretrained
from .save import save_sharded

__all__ = ["CheckpointError", "Checkpointer", "consolidate", "from_pretrained", "load_sharded", "save_sharded"]
