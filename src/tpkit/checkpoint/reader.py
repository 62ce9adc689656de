"""Read the region of a full tensor one rank holds, from the pieces that overlap it, touching only their bytes.

The region comes from the rank's `ShardLayout`: its segments along `dim` (the whole tensor when replicated),
concatenated in local order, in the stored orientation (`stored_local_shape`). A whole-tensor source (Hugging
Face files) is read with `layout.byte_ranges` straight into the destination; a tpkit checkpoint's pieces are
intersected with each segment's box and each intersection read as the byte runs of that sub-box.

Pieces carry a sha256 (tpkit checkpoints). `check_pieces` verifies, from disk, every piece a rank is about
to read (before anything changes: `load_sharded` into a live model); `read_region(..., verify=True)` instead
hashes a piece read whole from the bytes just read, with no second pass over the file (`from_pretrained`,
whose model is new and thrown away on error). Either way a rank verifies exactly the bytes it uses.
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch

from ..layout import ShardLayout
from .errors import CheckpointError
from .safetensors_file import Header, TensorInfo, read_ranges, sha256_bytes, sha256_range
from .sources import Entry, Piece

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


def check_piece(piece: Piece, info: TensorInfo, read: torch.Tensor | None = None) -> None:
    """Compare the piece's sha256 (if recorded) with `read` (the piece's bytes, just read whole) or with the
    file's bytes; raise CheckpointError naming the file and tensor."""
    if piece.sha256 is None:
        return
    got = sha256_bytes(read) if read is not None else sha256_range(piece.path, info.start, info.stop)
    if got != piece.sha256:
        raise CheckpointError(f"{piece.path}: tensor {piece.name!r}: sha256 differs from the manifest's (the file "
                              f"changed or is damaged)")


def check_pieces(entry: Entry, layout: ShardLayout, headers: dict[str, Header]) -> None:
    for piece in needed_pieces(entry, layout):
        check_piece(piece, headers[piece.path].tensors[piece.name])


def read_region(entry: Entry, layout: ShardLayout, headers: dict[str, Header], out: torch.Tensor,
                verify: bool = False) -> torch.Tensor:
    """Fill `out` (contiguous, `layout.stored_local_shape`, the entry's dtype) with the rank's region; with
    `verify`, check the sha256 of each piece used (from the bytes read when the piece was read whole)."""
    if entry.is_whole:
        piece = entry.pieces[0]
        info = headers[piece.path].tensors[piece.name]
        read_ranges(piece.path, info, layout.byte_ranges(entry.dtype.itemsize), out)
        if verify:
            check_piece(piece, info, out if out.numel() == math.prod(entry.shape) else None)
        return out
    for at, box in segment_boxes(layout):
        dest = out if layout.dim is None else out.narrow(layout.dim, at, box[layout.dim][1] - box[layout.dim][0])
        for piece in entry.pieces:
            inter = intersect(box, piece)
            if inter is None:
                continue
            local = tuple((a - o, b - o) for (a, b), o in zip(inter, piece.offsets))
            view = dest
            for d, ((a, b), (ba, _)) in enumerate(zip(inter, box)):
                view = view.narrow(d, a - ba, b - a)
            # Straight into the destination when the intersection is one contiguous block of it (a piece read
            # at the world size it was saved with always is); else through a buffer.
            tmp = view if view.is_contiguous() else torch.empty(view.shape, dtype=entry.dtype)
            info = headers[piece.path].tensors[piece.name]
            read_ranges(piece.path, info, box_ranges(piece.shape, local, entry.dtype.itemsize), tmp)
            if verify:
                check_piece(piece, info, tmp if tmp.numel() == math.prod(piece.shape) else None)
            if tmp is not view:
                view.copy_(tmp)
    return out
