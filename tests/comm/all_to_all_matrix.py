"""all_to_all's part of the op matrix (`matrix.run_matrix` runs it on threads, gloo processes and under mpirun).

Every rank rebuilds every rank's input (seeded by rank) and computes its expected result by cutting and
concatenating in one process (`reference`). Inputs are small integers, exact in every dtype.
"""
from __future__ import annotations

import torch

from tpkit.comm import CommError, split_sizes

from .matrix import Checker, debug_mode, rank_input

DTYPES = [torch.float64, torch.int64, torch.bfloat16]


def reference(inputs: list[torch.Tensor], sd: int, gd: int, scatter_sizes: list[list[int]], me: int) -> torch.Tensor:
    """Rank `me`'s result: piece `me` of every rank's input (cut by that rank's `scatter_sizes`), in rank order
    along `gd`. Differentiable, so the autograd tests use it too."""
    pieces = [x.narrow(sd, sum(sizes[:me]), sizes[me]) for x, sizes in zip(inputs, scatter_sizes)]
    return torch.cat(pieces, gd)


def counts(n: int) -> list[list[int]]:
    """Rank i sends counts[i][j] rows to rank j: uneven per pair, zeros included."""
    return [[(i + 2 * j + 1) % 3 for j in range(n)] for i in range(n)]


def _case(comm, c: Checker, what: str, inputs, sd, gd, ss, gs, want_sizes, **kw) -> None:
    """One call on this rank, against the reference; the input is left alone and the result is contiguous."""
    r = comm.rank
    x = inputs[r]
    before = x.clone()
    got = comm.all_to_all(x, sd, gd, scatter_sizes=ss, gather_sizes=gs, **kw)
    if kw.get("async_op"):
        got = got.wait()
    c.same(what, got, reference(inputs, sd % x.dim(), gd % x.dim(), want_sizes, r))
    c.true(f"{what}: a contiguous result", got.is_contiguous(), f"strides {got.stride()}")
    c.same(f"{what}: input kept", x, before)


def check_all_to_all(comm, c: Checker) -> None:
    """Ulysses (heads for sequence, a permuted input, uneven heads and sequence), back again, one dim with
    per-rank counts, defaults, async, a message too big for shared memory, bad arguments, mismatches."""
    n, r = comm.world_size, comm.rank
    heads = split_sizes(2 * n + 1, n)  # uneven
    seq = [2 + q % 2 for q in range(n)]  # every rank's own sequence length
    for dtype in DTYPES:
        # [B, S_r, H, D], non-contiguous: made as [B, H, S_r, D] and transposed
        xs = [rank_input(q, (2, 2 * n + 1, seq[q], 3), dtype, 20).transpose(1, 2) for q in range(n)]
        _case(comm, c, f"all_to_all heads -> sequence {dtype}", xs, 2, 1, None, seq, [heads] * n)
        back = [rank_input(q, (2, sum(seq), heads[q], 3), dtype, 21) for q in range(n)]
        _case(comm, c, f"all_to_all sequence -> heads {dtype}", back, -3, -2, seq, heads, [seq] * n)
        sent = counts(n)
        rows = [rank_input(q, (sum(sent[q]), 3), dtype, 22) for q in range(n)]
        _case(comm, c, f"all_to_all one dim, per-rank counts {dtype}", rows, 0, 0, sent[r],
              [sent[q][r] for q in range(n)], sent)
    even = [rank_input(q, (3, 2 * n + 1), torch.float32, 23) for q in range(n)]
    _case(comm, c, "all_to_all one dim, default sizes", even, -1, -1, None, None, [split_sizes(2 * n + 1, n)] * n)
    _case(comm, c, "all_to_all async", even, 1, 0, None, None, [split_sizes(2 * n + 1, n)] * n, async_op=True)
    # rank 0's input is over a shared-memory slot (1 MiB), the others' are tiny: every rank must take gloo together
    big = [[40_000 if q == 0 else 1] * n for q in range(n)]
    flat = [rank_input(q, (sum(big[q]), 8), torch.float32, 24) for q in range(n)]
    _case(comm, c, "all_to_all with one rank over the shared-memory slot", flat, 0, 0, big[r],
          [big[q][r] for q in range(n)], big)
    check_all_to_all_arguments(comm, c)
    if n > 1:
        if comm.backend == "threads":
            check_all_to_all_mismatches(comm, c)
        else:
            with debug_mode() as lines:
                check_all_to_all_mismatches(comm, c)
            want = (f"all_to_all shape=({n}, 2) dtype=torch.float32 scatter_dim=0 gather_dim=1 scatter_sizes={[1] * n} "
                    f"gather_sizes={[2] * n} group={comm.name}")
            c.true("TP_DEBUG logs all_to_all on logger tpkit", any(want in line for line in lines),
                   f"no line with {want!r} among {lines[-3:]}")


def check_all_to_all_arguments(comm, c: Checker) -> None:
    """ValueError naming the argument, raised before any peer is involved (so ranks may differ here)."""
    n, r = comm.world_size, comm.rank
    x = torch.ones(2 * n, 3)
    with c.raises("all_to_all scatter_dim out of range", ValueError, "all_to_all", "scatter_dim 2", f"({2 * n}, 3)"):
        comm.all_to_all(x, 2, 0)
    with c.raises("all_to_all gather_dim out of range", ValueError, "gather_dim -3"):
        comm.all_to_all(x, 0, -3)
    with c.raises("all_to_all dim that is not an int", ValueError, "scatter_dim 0.5"):
        comm.all_to_all(x, 0.5, 0)
    with c.raises("all_to_all scatter_sizes of the wrong length", ValueError, "scatter_sizes", f"{n} non-negative"):
        comm.all_to_all(x, 0, 1, [2 * n] + [0] * n)
    with c.raises("all_to_all scatter_sizes that do not add up", ValueError, "scatter_sizes", "add up to",
                  f"size {2 * n}", "omit scatter_sizes"):
        comm.all_to_all(x, 0, 1, [3] * n)
    with c.raises("all_to_all negative scatter_sizes", ValueError, "non-negative"):
        comm.all_to_all(x, 0, 1, [2 * n + 1] + [-1] + [0] * (n - 2) if n > 1 else [-1])
    with c.raises("all_to_all gather_sizes contradicting the input", ValueError, f"gather_sizes[{r}] = 7",
                  "gather_dim 1", "must be 3"):
        comm.all_to_all(x, 0, 1, None, [7] * n)
    with c.raises("all_to_all gather_sizes contradicting scatter_sizes (one dim)", ValueError,
                  f"gather_sizes[{r}] = 5", f"scatter_sizes[{r}] = 2"):
        comm.all_to_all(x, 0, 0, [2] * n, [5] * n)
    with c.raises("all_to_all of a non-tensor", TypeError, "all_to_all", "list"):
        comm.all_to_all([1, 2], 0, 0)


def check_all_to_all_mismatches(comm, c: Checker) -> None:
    """Calls that do not fit together: CommError naming all_to_all and the group on every rank (the torch and mpi
    backends compare under TP_DEBUG); the group still works afterwards."""
    n, r = comm.world_size, comm.rank
    sent = counts(n)
    expected = [sent[q][r] for q in range(n)]
    if r == 1:
        expected[0] += 1  # rank 1 expects one row more from rank 0 than rank 0 sends it
    with c.raises("all_to_all with sizes that disagree", CommError, "all_to_all", comm.name, "rank 0"):
        comm.all_to_all(torch.ones(sum(sent[r]), 2), 0, 0, sent[r], expected)
    with c.raises("all_to_all with other dims that differ", CommError, "all_to_all", comm.name):
        comm.all_to_all(torch.ones(n, 2 + r % 2, 3), 0, 2)
    c.same("the group works after all_to_all mismatches", comm.all_to_all(torch.ones(n, 2), 0, 1),
           torch.ones(1, 2 * n))
