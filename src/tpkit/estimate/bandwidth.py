"""How fast one rank's memory moves, as the calibration measures it (`calibrate.py`) for `machine.MachineRates`:
weights streamed past the caches (alone, or with every rank streaming at once), elementwise work, and the new pages a
tensor too large for the allocator to keep costs (`ops.FRESH_BLOCK_BYTES`).
"""
from __future__ import annotations

import math
import statistics
import time

import torch

from .ops import FRESH_BLOCK_BYTES

# Bytes of weights a matmul or streaming measurement rotates through: past the caches. A model's step reads its
# weights once each, layer after layer, so by the time a layer comes round again the others have evicted it: on
# this 2-core box (480 MiB of L3 reported, shared with the host) a [16000 x 640] LM head at 13 rows took 22 ms in
# a model's decode step and 8-9 ms repeated alone, and a rotation through 128 MiB or more reproduced the 22 ms.
COLD_BYTES = 128 << 20


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` calls of `fn` after an untimed one."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_stream_bandwidth(n: int = 1024, total: int = COLD_BYTES, repeats: int = 5,
                             stored: bool = False) -> float:
    """Bytes/s of weights read by matrix-vector products over a set of matrices larger than the caches, each
    read transposed (`x @ W.T`, nn.Linear) or, with `stored`, as stored (`x @ W`, Conv1D)."""
    ws = [torch.randn(n, n) for _ in range(max(1, total // (n * n * 4)))]
    x = torch.randn(1, n)
    if stored:
        return len(ws) * n * n * 4 / best_seconds(lambda: [torch.mm(x, w) for w in ws], repeats)
    return len(ws) * n * n * 4 / best_seconds(lambda: [torch.mm(x, w.t()) for w in ws], repeats)


def measure_shared_stream_bandwidth(comm, n: int = 1024, total: int = COLD_BYTES, repeats: int = 5) -> float:
    """Bytes/s one rank gets streaming weights (`x @ W.T` over matrices larger than the caches) while every rank of
    `comm` streams at the same time (call on all): a barrier before each repeat keeps them in step, and the median
    is kept, not the best (a best-of would catch a moment when the others were not reading). Ranks on one socket
    share its memory bus: two ranks each get about half of what one gets alone."""
    ws = [torch.randn(n, n) for _ in range(max(1, total // (n * n * 4)))]
    x = torch.randn(1, n)

    def once() -> float:
        comm.barrier()
        start = time.perf_counter()
        for w in ws:
            torch.mm(x, w.t())
        return time.perf_counter() - start
    once()
    return len(ws) * n * n * 4 / sorted(once() for _ in range(repeats))[repeats // 2]


def measure_copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes/s of an elementwise op over a large tensor (read + write counted, as the op trace counts them)."""
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    return 2 * nbytes / best_seconds(lambda: torch.mul(a, 1.0, out=b), repeats)


def measure_fresh_bandwidth(nbytes: int = 2 * FRESH_BLOCK_BYTES, repeats: int = 5) -> float:
    """Bytes/s at which new pages come to a tensor too large for the allocator to keep (`ops.FRESH_BLOCK_BYTES`):
    its bytes over what an elementwise op making its output takes beyond the same op writing into a kept tensor
    (the kernel faulting and zeroing each page; on this 2-core VM 1.2-1.8 us per 4 KiB page inside an op, against
    0.9 us to fill a fresh buffer alone, so it is timed inside an op). The two alternate, and the median difference
    is kept. 0 where making the output costs nothing more (an allocator that keeps freed memory)."""
    a = torch.ones(nbytes // 4)
    kept = torch.empty_like(a)
    torch.sqrt(a, out=kept)
    differences = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        torch.sqrt(a)  # made, then freed: unmapped
        made = time.perf_counter() - start
        start = time.perf_counter()
        torch.sqrt(a, out=kept)
        differences.append(made - (time.perf_counter() - start))
    extra = statistics.median(differences[1:])
    return nbytes / extra if extra > 0 else 0.0
