"""The layout of an all-to-all: which piece of whose tensor lands where, shared by every backend.

`Communicator.all_to_all(t, scatter_dim, gather_dim, scatter_sizes, gather_sizes)` cuts `t` along `scatter_dim`
into one piece per rank (piece j, of `scatter_sizes[j]`, goes to rank j) and concatenates the pieces it receives,
in rank order, along `gather_dim` (the piece from rank i has `gather_sizes[i]` there). Backends move bytes; what
the bytes mean is decided here, once:

- `pack` lays a tensor out for sending: `scatter_dim` first, contiguous, flat, so piece j is one range of
  `send_counts[j]` elements (what torch's `all_to_all_single`, MPI's `Alltoallv` and a send per peer all take);
- the piece from rank i arrives in that same layout, `recv_counts[i]` elements; `unpack` puts the pieces back in
  the tensor's own dim order and concatenates them along `gather_dim` into a new tensor allocated contiguous
  (never `empty_like` of a permuted view: it keeps the view's strides while the data arrives in order).

When the two dims differ, a received piece's size along `scatter_dim` is taken to be the receiver's own
`scatter_sizes[rank]`, so every rank passes the same `scatter_sizes`; when they are the same dim, each rank's
lists are its own send and receive sizes (torch's input / output split sizes). `size_mismatch` and
`piece_mismatch` say in words when the ranks' calls do not fit together.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .errors import CommError


def output_shape(shape: Sequence[int], sd: int, gd: int, ss: Sequence[int], gs: Sequence[int], rank: int) -> list[int]:
    """The result's shape on `rank` for an input of `shape` (dims and sizes already resolved)."""
    out = list(shape)
    if sd != gd:
        out[sd] = ss[rank]
    out[gd] = sum(gs)
    return out


def piece_shape(shape: Sequence[int], sd: int, gd: int, ss: Sequence[int], gs: Sequence[int], rank: int,
                src: int) -> list[int]:
    """The shape, in the tensor's own dim order, of the piece `rank` receives from rank `src`."""
    piece = list(shape)
    if sd != gd:
        piece[sd] = ss[rank]
    piece[gd] = gs[src]
    return piece


def _numel(shape: Sequence[int]) -> int:
    """The product of `shape`, as a plain loop (torch.compile traces these helpers inside autograd Functions,
    where it takes no generator expressions)."""
    out = 1
    for s in shape:
        out *= s
    return out


def _moved(shape: Sequence[int], sd: int) -> list[int]:
    """`shape` with `sd` first: the layout pieces travel in."""
    return [shape[sd]] + [s for d, s in enumerate(shape) if d != sd]


def pack(tensor: torch.Tensor, sd: int) -> torch.Tensor:
    """`tensor` (detached) with `sd` first, contiguous and flat: piece j is one range of elements. A view of the
    input when it is laid out so already (scatter_dim 0, contiguous), else a copy."""
    moved = tensor.detach() if sd == 0 else tensor.detach().movedim(sd, 0)
    return moved.contiguous().reshape(-1)


def send_counts(shape: Sequence[int], sd: int, ss: Sequence[int]) -> list[int]:
    """Elements of each piece sent (piece j to rank j) from `pack`'s layout."""
    row = _numel([s for d, s in enumerate(shape) if d != sd])
    return [s * row for s in ss]


def recv_counts(shape: Sequence[int], sd: int, gd: int, ss: Sequence[int], gs: Sequence[int], rank: int) -> list[int]:
    """Elements of each piece received (from rank i, in rank order)."""
    return [_numel(piece_shape(shape, sd, gd, ss, gs, rank, i)) for i in range(len(gs))]


def offsets(counts: Sequence[int]) -> list[int]:
    """Where each piece starts, and the total at the end: [0, c0, c0 + c1, ...]."""
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def unpack(flat: torch.Tensor, shape: Sequence[int], sd: int, gd: int, ss: Sequence[int], gs: Sequence[int],
           rank: int, traced: bool = False) -> torch.Tensor:
    """The result from `flat`, the received pieces in rank order each in its sender's `pack` layout: a new
    contiguous tensor of `output_shape`. `traced`: no `out=` (inside a compiled graph)."""
    out_shape = output_shape(shape, sd, gd, ss, gs, rank)
    if sd == gd:  # the pieces are consecutive rows of the moved result
        whole = flat.view(_moved(out_shape, sd))
        return whole if sd == 0 else whole.movedim(0, sd).contiguous()
    pieces, start = [], 0
    for i in range(len(gs)):
        piece = piece_shape(shape, sd, gd, ss, gs, rank, i)
        count = _numel(piece)
        pieces.append(flat[start:start + count].view(_moved(piece, sd)).movedim(0, sd))
        start += count
    if traced:
        return torch.cat(pieces, gd).contiguous()
    return torch.cat(pieces, gd, out=flat.new_empty(out_shape))


def local(tensor: torch.Tensor, sd: int, gd: int, ss: Sequence[int], gs: Sequence[int], rank: int,
          received: Sequence[torch.Tensor]) -> torch.Tensor:
    """The result from `received[i]`, the piece from rank i in the tensor's own dim order (the threads backend's
    pieces are views of its peers' tensors)."""
    out = tensor.new_empty(output_shape(tensor.shape, sd, gd, ss, gs, rank))
    return torch.cat(list(received), gd, out=out)


def size_mismatch(rows: Sequence[Sequence[int]], same_dim: bool) -> str | None:
    """What is wrong, in words, with every rank's `scatter_sizes + gather_sizes` (`rows[i]`, 2n ints), or None.

    Every rank sees the same rows, so every rank comes to the same verdict."""
    n = len(rows)
    if not same_dim:  # every rank cuts and expects the same pieces
        for i, row in enumerate(rows):
            if list(row) != list(rows[0]):
                return (f"with scatter_dim != gather_dim every rank must pass the same scatter_sizes and "
                        f"gather_sizes; rank 0 has {list(rows[0][:n])}, {list(rows[0][n:])} and rank {i} has "
                        f"{list(row[:n])}, {list(row[n:])}")
        return None
    for i in range(n):
        for j in range(n):
            if rows[i][j] != rows[j][n + i]:
                return (f"rank {i} sends {rows[i][j]} (its scatter_sizes[{j}]) to rank {j}, which expects "
                        f"{rows[j][n + i]} (its gather_sizes[{i}]); each rank's gather_sizes[i] must be rank i's "
                        f"scatter_sizes[its rank]")
    return None


def piece_mismatch(calls: Sequence[tuple]) -> str | None:
    """What is wrong, in words, with every rank's call `(shape, sd, gd, ss, gs)`, or None: the dims must agree
    and every piece sent must have the shape its receiver expects."""
    dims = {(sd, gd) for _, sd, gd, _, _ in calls}
    if len(dims) > 1:
        return "ranks passed different (scatter_dim, gather_dim): " + ", ".join(
            f"rank {r}: {(c[1], c[2])}" for r, c in enumerate(calls))
    for i, (shape_i, sd, _, ss_i, _) in enumerate(calls):
        for j, (shape_j, _, gd, ss_j, gs_j) in enumerate(calls):
            sent = list(shape_i)
            sent[sd] = ss_i[j]
            expected = piece_shape(shape_j, sd, gd, ss_j, gs_j, j, i)
            if sent != expected:
                return (f"rank {i} (input shape {list(shape_i)}) sends rank {j} a piece of shape {sent}, but rank "
                        f"{j} (input shape {list(shape_j)}) expects {expected}")
    return None


def via_all_gather(comm, tensor: torch.Tensor, sd: int, gd: int, ss: list[int], gs: list[int]) -> torch.Tensor:
    """An all-to-all from two all-gathers (every rank's sizes, then every rank's packed tensor), each rank keeping
    its pieces: correct on any backend that has all_gather, at n times the bytes. `Communicator`'s default."""
    n, me = comm.world_size, comm.rank
    packed = pack(tensor, sd)
    mine = torch.tensor([ss + gs + [packed.numel()]], dtype=torch.int64, device=tensor.device)
    rows = comm.all_gather(mine).tolist()
    problem = size_mismatch([row[:2 * n] for row in rows], sd == gd)
    if problem:
        raise CommError(f"all_to_all: {problem}")
    numels = [row[-1] for row in rows]
    every = comm.all_gather(packed, sizes=numels)
    starts = offsets(numels)
    counts = recv_counts(tensor.shape, sd, gd, ss, gs, me)
    pieces = []
    for i, row in enumerate(rows):
        sent_rows = sum(row[:n])
        per_row = numels[i] // sent_rows if sent_rows else 0
        begin = starts[i] + sum(row[:me]) * per_row
        pieces.append(every[begin:begin + counts[i]])
    return unpack(torch.cat(pieces), tensor.shape, sd, gd, ss, gs, me)
