"""Read the region of a full tensor one rank holds, from the pieces that overlap it, touching only their bytes.

The region comes from the rank's `ShardLayout`: its segments along `dim` (the whole tensor when replicated),
concatenated in local order, in the stored orientation (`stored_local_shape`). `plan_copies` says which bytes
of which file fill which sub-box of the region: for a whole-tensor source (Hugging Face files) one Copy, the
layout's `byte_ranges`; for a tpkit checkpoint (or tensors transformers fuses or cuts on load) one per piece
overlapping a segment, the byte runs of that intersection (in the stored tensor the piece is part of, when it is
`within` one). `fill` performs one Copy: straight into the destination's memory, a sub-box that is not
contiguous there (a piece of a row-split tensor read at another world size) by one positional read scattered
over its rows (`scatter`), never through a temporary; or through the staging buffers (`staging.py`) when
the destination is on a device. Copies are independent, so a caller may run several at once (`fill.py`).

Pieces carry a sha256 (tpkit checkpoints). `check_pieces` verifies, from disk, every piece a rank is about
to read (before anything changes: `load_sharded` into a live model); `fill(..., verify=True)` instead
hashes a piece read whole from the bytes just read, with no second pass over the file (`from_pretrained`,
whose model is new and thrown away on error), and a piece read in part from disk. Either way a rank verifies
exactly the pieces it uses.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from typing import Iterator, Sequence

import torch

from ..layout import ShardLayout
from .errors import CheckpointError
from .safetensors_file import Header, TensorInfo, byte_view, pread_runs, pread_scatter, sha256_range
from .sources import Entry, Piece
from .staging import Staging

Box = tuple[tuple[int, int], ...]


def segment_boxes(layout: ShardLayout) -> list[tuple[int, Box]]:
    """`(position along dim in the local tensor, box in the full tensor)` for each of the rank's segments."""
    full = tuple((0, s) for s in layout.full_shape)
    if layout.dim is None:
        return [(0, full)]
    out, at = [], 0
    for a, b in layout.segments():
        box = list(full)
        box[layout.dim] = (a, b)
        out.append((at, tuple(box)))
        at += b - a
    return out


def intersect(box: Box, piece: Piece) -> Box | None:
    out = tuple((max(a, o), min(b, o + s)) for (a, b), o, s in zip(box, piece.offsets, piece.shape))
    return out if all(a < b for a, b in out) else None


def volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def uncovered(entry: Entry, layout: ShardLayout) -> int:
    """How many elements of the rank's region no piece holds (0 for a readable entry); checked before reading."""
    missing = 0
    for _, box in segment_boxes(layout):
        missing += volume(box) - sum(volume(i) for p in entry.pieces if (i := intersect(box, p)) is not None)
    return missing


def box_ranges(shape: Sequence[int], box: Box, itemsize: int) -> list[tuple[int, int]]:
    """Byte ranges of the row-major tensor `shape` that make up `box`, in row-major order, merged."""
    if not shape:
        return [(0, itemsize)]
    j = len(shape) - 1  # the outermost dim from which on the box is one contiguous run
    while j > 0 and box[j] == (0, shape[j]):
        j -= 1
    inner = math.prod(shape[j + 1:])
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    out: list[tuple[int, int]] = []
    for idx in itertools.product(*(range(a, b) for a, b in box[:j])):
        base = sum(i * s for i, s in zip(idx, strides))
        start = (base + box[j][0] * inner) * itemsize
        stop = (base + box[j][1] * inner) * itemsize
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return out


def needed_pieces(entry: Entry, layout: ShardLayout) -> list[Piece]:
    """The pieces of `entry` that overlap the rank's region."""
    if entry.is_whole:
        return [entry.pieces[0]]
    boxes = [box for _, box in segment_boxes(layout)]
    return [p for p in entry.pieces if any(intersect(box, p) is not None for box in boxes)]


def check_piece(piece: Piece, info: TensorInfo, digest: str | None = None) -> None:
    """Compare the piece's sha256 (if recorded) with `digest` (taken from the piece's bytes as they were read
    whole) or, without one, with the file's bytes; raise CheckpointError naming the file and tensor."""
    if piece.sha256 is None:
        return
    got = digest if digest is not None else sha256_range(piece.path, info.start, info.stop)
    if got != piece.sha256:
        raise CheckpointError(f"{piece.path}: tensor {piece.name!r}: sha256 differs from the manifest's (the file "
                              f"changed or is damaged)")


def check_pieces(entry: Entry, layout: ShardLayout, headers: dict[str, Header]) -> None:
    for piece in needed_pieces(entry, layout):
        check_piece(piece, headers[piece.path].tensors[piece.name])


@dataclasses.dataclass(frozen=True)
class Copy:
    """The part of a rank's region one piece holds: the file's byte `runs` (absolute offsets, in order) are,
    back to back, the row-major elements of the region's sub-box at offsets `at` with `shape`. `whole`: the
    runs are all of the piece's bytes, so its sha256 can be taken from the bytes as they are read."""

    piece: Piece
    info: TensorInfo
    runs: tuple[tuple[int, int], ...]
    at: tuple[int, ...]
    shape: tuple[int, ...]
    whole: bool

    @property
    def nbytes(self) -> int:
        return sum(b - a for a, b in self.runs)


def plan_copies(entry: Entry, layout: ShardLayout, headers: dict[str, Header]) -> list[Copy]:
    """The Copies that fill the rank's region (`layout.stored_local_shape`, the entry's dtype) of `entry`."""
    size = entry.dtype.itemsize
    if entry.is_whole:  # a Hugging Face tensor: the layout's byte ranges, in local order, are the region
        piece = entry.pieces[0]
        info = headers[piece.path].tensors[piece.name]
        shape = tuple(layout.stored_local_shape)
        runs = tuple((info.start + a, info.start + b) for a, b in layout.byte_ranges(size))
        return [Copy(piece, info, runs, (0,) * len(shape), shape, math.prod(shape) == math.prod(entry.shape))]
    out = []
    for at, box in segment_boxes(layout):
        for piece in entry.pieces:
            inter = intersect(box, piece)
            if inter is None:
                continue
            info = headers[piece.path].tensors[piece.name]
            stored, shift = (piece.shape, (0,) * len(inter)) if piece.within is None else (info.shape, piece.within)
            local = tuple((a - o + w, b - o + w) for (a, b), o, w in zip(inter, piece.offsets, shift))
            pos = tuple(a - ba + (at if d == layout.dim else 0) for d, ((a, _), (ba, _)) in enumerate(zip(inter, box)))
            runs = tuple((info.start + a, info.start + b) for a, b in box_ranges(stored, local, size))
            out.append(Copy(piece, info, runs, pos, tuple(b - a for a, b in inter),
                            volume(inter) == math.prod(piece.shape) and piece.within is None))
    return out


def chunks(runs: Sequence[tuple[int, int]], limit: int) -> Iterator[tuple[list[tuple[int, int]], int]]:
    """`runs` cut into consecutive groups of at most `limit` bytes: `(runs, bytes)` each."""
    group, size = [], 0
    for a, b in runs:
        while a < b:
            n = min(b - a, limit - size)
            group.append((a, a + n))
            size, a = size + n, a + n
            if size == limit:
                yield group, size
                group, size = [], 0
    if group:
        yield group, size


def scatter(copy: Copy, region_shape: Sequence[int], itemsize: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """How to read `copy` straight into a contiguous region of `region_shape`: for each of its file runs, the
    region byte ranges `(start, stop)` that run's bytes fill, in order. A sub-box that is not contiguous in
    the region (a column block of a row-split piece) is many ranges filled by one positional read."""
    shape = copy.shape
    strides = [math.prod(region_shape[d + 1:]) for d in range(len(region_shape))]
    j = len(shape) - 1  # the outermost dim from which on the sub-box is one contiguous run of the region
    while j > 0 and shape[j] == region_shape[j]:
        j -= 1
    run = math.prod(shape[j:]) * itemsize if shape else itemsize
    base = sum(a * s for a, s in zip(copy.at, strides))
    starts = [(base + sum(i * s for i, s in zip(idx, strides))) * itemsize
              for idx in itertools.product(*(range(n) for n in shape[:j]))]
    out, k, used = [], 0, 0  # the region run being filled, and how much of it is
    for a, b in copy.runs:
        pieces, left = [], b - a
        while left:
            take = min(left, run - used)
            start = starts[k] + used
            if pieces and pieces[-1][1] == start:
                pieces[-1] = (pieces[-1][0], start + take)
            else:
                pieces.append((start, start + take))
            used, left = used + take, left - take
            if used == run:
                k, used = k + 1, 0
        out.append((a, pieces))
    return out


def fill(copy: Copy, region: torch.Tensor, staging: Staging | None = None, verify: bool = False) -> None:
    """Read `copy` into its sub-box of `region` (contiguous; the entry's dtype). Without `staging` the region is
    host memory and the bytes go straight into it (`scatter`); with it, they go through the staging buffers
    and are copied to the region's device. `verify`: check the piece's sha256, from the bytes as read when
    the copy is the whole piece, else from disk."""
    digest = hashlib.sha256() if verify and copy.whole and copy.piece.sha256 is not None else None
    with torch.no_grad():
        if staging is None:
            data = byte_view(region)
            reads = [(a, [data[x:y] for x, y in pieces])
                     for a, pieces in scatter(copy, region.shape, region.element_size())]
            pread_scatter(copy.piece.path, copy.info.name, reads)
            if digest is not None:
                for _, views in reads:
                    for view in views:
                        digest.update(view)
        else:
            staged(copy, region, staging, digest)
    if verify:
        check_piece(copy.piece, copy.info, digest.hexdigest() if digest is not None else None)


def staged(copy: Copy, region: torch.Tensor, staging: Staging, digest) -> None:
    """`fill` through the staging buffers: chunks of the file runs, in order, each copied to the device as
    the next is read; a sub-box not contiguous in the region is gathered in a device temporary first."""
    view = region
    for d, (a, s) in enumerate(zip(copy.at, copy.shape)):
        view = view.narrow(d, a, s)
    if view.is_contiguous():
        into = view
    else:
        with staging.on_stream():
            into = torch.empty(copy.shape, dtype=region.dtype, device=region.device)
    if into.numel():
        dst, at = into.view(-1).view(torch.uint8), 0
        for group, n in chunks(copy.runs, staging.chunk_bytes):
            buf = staging.buffer()
            try:
                data = byte_view(buf.view((n,), torch.uint8))
                pread_runs(copy.piece.path, copy.info.name, group, data)
                if digest is not None:
                    digest.update(data)
            except BaseException:
                staging.give_back(buf)
                raise
            staging.send(buf, n, dst[at:at + n])
            at += n
    if into is not view:
        with staging.on_stream():
            view.copy_(into)


def read_region(entry: Entry, layout: ShardLayout, headers: dict[str, Header], out: torch.Tensor,
                verify: bool = False) -> torch.Tensor:
    """Fill `out` (contiguous host memory, `layout.stored_local_shape`, the entry's dtype) with the rank's
    region, one piece after another; with `verify`, check the sha256 of each piece used."""
    for copy in plan_copies(entry, layout, headers):
        fill(copy, out, None, verify)
    return out
