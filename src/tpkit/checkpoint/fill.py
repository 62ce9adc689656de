"""Filling a model's tensors from an opened source: several reads in flight, each target finished in order.

Why threads: a load is a few hundred independent byte ranges. One thread reading them one after another
leaves the disk (or, from the page cache, the other cores) idle between calls; `os.preadv` and hashlib
release the GIL, so a few threads keep several ranges in flight. Each Copy (reader.py) is one task; the
main thread waits for a target's copies, then finishes it (dtype conversion, transpose, an FSDP2 shard,
progress), while later targets are still being read.

Memory: a target whose destination takes the file's bytes as they are (same dtype and orientation,
contiguous) is read straight into it and costs nothing extra. Any other is read into a region tensor first;
the regions alive at once are bounded by `WINDOW_BYTES` (a larger one waits for the window to drain), so a
load never holds more than the model plus the window. With a `Staging` (staging.py) every byte goes through
its few reused buffers to the device, and host memory is the pool's whatever the model.

Mapped (`mapped=True`, a new model on the CPU, `TPKIT_MAP_WEIGHTS` not 0): the file is memory-mapped
privately, as safetensors and transformers load. A direct target whose bytes are one aligned range (a
replicated tensor, a column split's rows, a piece saved at this world size) becomes a view of the mapping:
nothing is read until used, the pages are the page cache's (shared by the ranks, evictable), and a write (an
optimizer step) copies the page it touches, never the file. Any other target of a whole tensor (a row split's
column block, a dtype conversion, a transpose) is one strided torch copy from the mapping per segment, not a
positional read per row.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import math
import mmap
import os
from typing import Iterable

import torch

from ..layout import ShardLayout
from .memory import empty_for_load
from .mesh import is_sharded, put
from .progress import Progress
from .reader import check_piece, fill, needed_pieces, plan_copies
from .sources import Entry, Source
from .staging import Staging

THREADS_ENV = "TPKIT_READ_THREADS"
MAP_ENV = "TPKIT_MAP_WEIGHTS"
WINDOW_BYTES = 64 << 20  # region tensors (dtype conversion, transposes) alive at once; at least one


def read_threads() -> int:
    """Reader threads: `TPKIT_READ_THREADS`, else 4 (ranges in flight from one rank; more buys nothing from the
    page cache on few cores, and an NVMe drive is already busy at this queue depth with several ranks)."""
    return max(1, int(os.environ.get(THREADS_ENV, "4")))


def map_weights() -> bool:
    """Whether a new model's CPU tensors may be views of the checkpoint's file mappings (`TPKIT_MAP_WEIGHTS`,
    default on; 0 copies every byte into fresh memory, for a checkpoint that may be overwritten in place while
    the model lives)."""
    return os.environ.get(MAP_ENV, "1") != "0"


@dataclasses.dataclass
class Target:
    """One tensor to read: source entry `key`, this rank's `layout`, wanted `dtype`, and the tensor to fill in
    place (`dest`, a model tensor) or None (a new tensor, made on `device`: optimizer state). `name` is the
    model's key."""

    key: str
    name: str
    layout: ShardLayout
    dtype: torch.dtype
    dest: torch.Tensor | None = None
    device: torch.device | None = None


@dataclasses.dataclass
class _Job:
    target: Target
    entry: Entry
    region: torch.Tensor  # the destination itself (direct) or a region tensor to finish from
    direct: bool
    futures: list[concurrent.futures.Future]
    held: int  # bytes of the region tensor (0 when direct)


def takes_bytes(t: Target, e: Entry) -> bool:
    """Whether the file's bytes can go straight into `t.dest`: same dtype, stored orientation, contiguous."""
    d = t.dest
    return (d is not None and not is_sharded(d) and e.dtype == d.dtype and not t.layout.transposed
            and d.is_contiguous())


def read_targets(source: Source, targets: list[Target], progress: Progress, verify: bool = False,
                 staging: Staging | None = None, threads: int | None = None,
                 mapped: bool = False) -> dict[str, torch.Tensor]:
    """Read every target (after validation and agreement). Model tensors are filled in place; new tensors are
    returned by key. `verify`: check each piece's sha256 as it is read (a new model; a live one is checked
    before with `check_targets`). `staging`: read through its buffers (a device destination); it is finished
    (every copy complete) before this returns, error or not. `mapped`: a model tensor whose bytes are one range
    of a file takes a view of the file's private mapping as its data (see the module's doc; a new model only:
    its tensors change storage)."""
    out: dict[str, torch.Tensor] = {}
    maps: dict[str, mmap.mmap] | None = {} if mapped and staging is None else None
    jobs: collections.deque[_Job] = collections.deque()
    held = 0
    pool = concurrent.futures.ThreadPoolExecutor(threads or read_threads(), thread_name_prefix="tpkit-read")
    try:
        with torch.no_grad():
            for t in sorted(targets, key=lambda t: first_byte(source, source.entries[t.key])):
                e = source.entries[t.key]
                need = 0 if takes_bytes(t, e) else t.layout.local_numel * e.dtype.itemsize
                while jobs and held + need > WINDOW_BYTES:
                    held -= finish(jobs.popleft(), staging, out, progress)
                jobs.append(start(source, t, e, pool, staging, verify, maps))
                held += jobs[-1].held
            while jobs:
                held -= finish(jobs.popleft(), staging, out, progress)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on error: no thread may still write once we return
        if staging is not None:
            staging.finish()
    return out


def first_byte(source: Source, e: Entry) -> tuple[str, int]:
    """Where an entry's first piece starts: targets are read in file order (sequential for a cold disk)."""
    if not e.pieces:
        return "", 0
    p = e.pieces[0]
    return p.path, source.headers[p.path].tensors[p.name].start


def start(source: Source, t: Target, e: Entry, pool, staging: Staging | None, verify: bool,
          maps: dict[str, mmap.mmap] | None = None) -> _Job:
    """Allocate the target's region (unless direct) and submit its copies; with `maps` (mapped reads), a direct
    CPU target that is one range of a file takes a view of its mapping, its sha256 checked in the pool."""
    direct = takes_bytes(t, e)
    if maps is not None and t.dest is not None and t.dest.device.type == "cpu" and not is_sharded(t.dest):
        parts = mapped_parts(source, t, e, maps)
        if parts is not None:
            if direct and len(parts) == 1 and parts[0].is_contiguous():
                t.dest.data = parts[0]
                futures = [pool.submit(check_mapped, e, t.layout, source, parts[0])] if verify else []
            else:
                futures = [pool.submit(copy_parts, parts, t, e, source, verify, maps)]
            return _Job(t, e, t.dest, True, futures, 0)
    if direct:
        region = t.dest.data
    else:
        device = t.dest.device if t.dest is not None else (t.device or torch.device("cpu"))
        if device.type == "cpu":
            region = empty_for_load(t.layout.stored_local_shape, e.dtype)
        else:
            with staging.on_stream():
                region = torch.empty(t.layout.stored_local_shape, dtype=e.dtype, device=device)
    if staging is None and region.device.type != "cpu":
        raise RuntimeError(f"read_targets: {t.name} is on {region.device}; a device destination needs a Staging")
    futures = [pool.submit(fill, c, region, staging, verify) for c in plan_copies(e, t.layout, source.headers)]
    return _Job(t, e, region, direct, futures, 0 if direct else region.numel() * region.element_size())


def mapped_parts(source: Source, t: Target, e: Entry, maps: dict[str, mmap.mmap]) -> list[torch.Tensor] | None:
    """Views of the mapped file (each file mapped once into `maps`) that are, concatenated along the layout's
    dim in order, the target's region in stored orientation: the layout's segments of a whole tensor (a Hugging
    Face file), or one piece holding the whole region as one range (a tpkit checkpoint at its world size).
    None when the bytes are not laid out so (pieces of other world sizes: positional reads) or misaligned."""
    size = e.dtype.itemsize
    if t.layout.local_numel == 0:
        return None
    if e.is_whole:
        piece = e.pieces[0]
        info = source.headers[piece.path].tensors[piece.name]
        if info.start % size:
            return None
        full = _mapped(maps, piece.path, e.dtype, info.start, math.prod(e.shape)).view(e.shape)
        if t.layout.dim is None:
            return [full]
        return [full.narrow(t.layout.dim, a, b - a) for a, b in t.layout.segments()]
    copies = plan_copies(e, t.layout, source.headers)
    shape = tuple(t.layout.stored_local_shape)
    if len(copies) != 1 or tuple(copies[0].shape) != shape or not copies[0].runs:
        return None
    runs = copies[0].runs
    if any(a[1] != b[0] for a, b in zip(runs, runs[1:])) or runs[0][0] % size:
        return None
    return [_mapped(maps, copies[0].piece.path, e.dtype, runs[0][0], t.layout.local_numel).view(shape)]


def _mapped(maps: dict[str, mmap.mmap], path: str, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    if path not in maps:
        with open(path, "rb") as f:
            maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return torch.frombuffer(maps[path], dtype=dtype, count=count, offset=offset)


def copy_parts(parts: list[torch.Tensor], t: Target, e: Entry, source: Source, verify: bool,
               maps: dict[str, mmap.mmap]) -> None:
    """Copy mapped `parts` into the target's tensor (dtype converted, transposed back), each at its place
    along the layout's dim; then drop the source's pages from this process (a row split's copy faults in the
    whole tensor: kept, the file's pages of every other rank's columns would count in this rank's memory until
    the end of the load) and, with `verify`, check the pieces' sha256 from disk."""
    stored = t.dest.data.t() if t.layout.transposed else t.dest.data
    dim, at = t.layout.dim, 0
    with torch.no_grad():
        if dim is None:  # replicated: one part, the whole tensor
            stored.copy_(parts[0])
        else:
            for part in parts:
                stored.narrow(dim, at, part.shape[dim]).copy_(part)
                at += part.shape[dim]
    for piece in needed_pieces(e, t.layout):
        info = source.headers[piece.path].tensors[piece.name]
        release(maps[piece.path], info.start, info.stop)
        if verify:
            check_piece(piece, info)


def release(mapping: mmap.mmap, start: int, stop: int) -> None:
    """Unmap the whole pages inside bytes [start, stop) from this process (they stay in the page cache; a later
    touch maps them again). Safe during a load: no page of the mapping has been written, so none holds data of
    its own (a page shared with a view is mapped back on its next use)."""
    page = mmap.PAGESIZE
    a, b = -(-start // page) * page, stop // page * page
    if b > a and hasattr(mmap, "MADV_DONTNEED"):  # not on every platform: there the pages stay until the end
        mapping.madvise(mmap.MADV_DONTNEED, a, b - a)


def check_mapped(e: Entry, layout: ShardLayout, source: Source, view: torch.Tensor) -> None:
    """A mapped view's piece sha256: from the mapped bytes when they are the whole piece, else from disk."""
    for piece in needed_pieces(e, layout):
        info = source.headers[piece.path].tensors[piece.name]
        digest = None
        if piece.sha256 is not None and view.numel() * view.element_size() == info.stop - info.start:
            digest = hashlib.sha256(view.reshape(-1).view(torch.uint8).numpy()).hexdigest()
        check_piece(piece, info, digest)


def finish(job: _Job, staging: Staging | None, out: dict, progress: Progress) -> int:
    """Wait for the job's copies (raising the first failure), then put its region where it goes."""
    for f in job.futures:
        f.result()
    t = job.target
    if not job.direct:
        value_shape = job.region.t().shape if t.layout.transposed else job.region.shape
        new = None  # a new device tensor is made on the default stream (it outlives the staging stream)
        if t.dest is None and job.region.device.type != "cpu":
            new = torch.empty(value_shape, dtype=t.dtype, device=job.region.device)
        with staging.on_stream() if staging is not None else contextlib.nullcontext():
            value = (job.region.t() if t.layout.transposed else job.region).to(t.dtype)
            if is_sharded(t.dest):
                put(t.dest, value)
            elif t.dest is not None:
                t.dest.data.copy_(value)
            elif new is not None:
                out[t.key] = new.copy_(value)
            else:
                out[t.key] = value.contiguous()
    progress.advance(t.layout.local_numel * job.entry.dtype.itemsize)
    return job.held


def check_targets(source: Source, targets: Iterable[Target], threads: int | None = None) -> None:
    """Check, from disk, the sha256 of every piece the targets will read (each piece once, several at a
    time); raise the first failure in target order. Run before anything changes."""
    pieces = {}
    for t in targets:
        for p in needed_pieces(source.entries[t.key], t.layout):
            pieces.setdefault((p.path, p.name), p)
    with concurrent.futures.ThreadPoolExecutor(threads or read_threads(), thread_name_prefix="tpkit-check") as pool:
        futures = [pool.submit(check_piece, p, source.headers[p.path].tensors[p.name]) for p in pieces.values()
                   if p.sha256 is not None]
        for f in futures:
            f.result()
