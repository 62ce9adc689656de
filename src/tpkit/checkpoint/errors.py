"""`CheckpointError`: every bad checkpoint input, raised on every rank before any parameter changes.

It subclasses ValueError because the input (a file, a directory, a model that does not match it) is wrong,
not the program; the message always names the file and, where one is involved, the tensor.
"""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be read into this model: truncated or missing file, corrupt header, wrong
    shape or dtype, missing or unexpected keys, checksum mismatch. Raised before anything is changed."""
