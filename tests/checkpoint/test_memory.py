"""Load destinations: 4 KiB pages unless TPKIT_HUGE_PAGES=1 asks for huge-page advice (memory.py says why)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tpkit.checkpoint import memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not memory._libc_madvise()
                                or not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                                reason="madvise(MADV_HUGEPAGE) needs Linux with transparent huge pages")

BIG = (16 << 20,)  # 64 MiB of float32: above glibc's largest mmap threshold, so the tensor is its own mapping


def _vm_flags(t: torch.Tensor) -> list[str]:
    """The VmFlags of the mapping holding the tensor's first whole page."""
    addr = (t.data_ptr() + 4095) // 4096 * 4096
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            a, b = (int(x, 16) for x in head.split("-"))
            inside = a <= addr < b
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError("no mapping holds the tensor")


def test_destinations_are_not_advised_by_default(monkeypatch):
    monkeypatch.delenv(memory.HUGE_PAGES_ENV, raising=False)
    t = memory.empty_for_load(BIG, torch.float32)
    assert t.shape == BIG and t.dtype == torch.float32
    assert "hg" not in _vm_flags(t)


def test_huge_pages_are_advised_when_asked(monkeypatch):
    monkeypatch.setenv(memory.HUGE_PAGES_ENV, "1")
    t = memory.empty_for_load(BIG, torch.float32)
    assert "hg" in _vm_flags(t)
