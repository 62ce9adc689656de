"""Fresh destination memory for a load, backed by transparent huge pages where the kernel offers them.

A new tensor's pages are mapped and zeroed by the kernel on first write, one 4 KiB fault at a time; filling
0.3 GB of new parameters from the page cache spends more time in those faults than in copying. Advising the
kernel (`madvise(MADV_HUGEPAGE)`, Linux, THP in "madvise" or "always" mode) turns them into 2 MiB faults:
the read of a rank's shards took 0.07 s instead of 0.16 s on the development box. Elsewhere, or when the
call fails, this does nothing.
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import torch

_MIN_BYTES = 2 << 20  # below one huge page there is nothing to gain
_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
                _madvise = fn
            except (OSError, AttributeError):
                pass
    return _madvise


def empty_for_load(shape, dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype)` on the CPU, its whole pages advised as huge-page candidates."""
    t = torch.empty(shape, dtype=dtype)
    size = t.numel() * t.element_size()
    fn = _libc_madvise() if size >= _MIN_BYTES else None
    if fn:
        page = mmap.PAGESIZE
        start = (t.data_ptr() + page - 1) // page * page
        stop = (t.data_ptr() + size) // page * page
        if stop > start:
            fn(start, stop - start, mmap.MADV_HUGEPAGE)
    return t
