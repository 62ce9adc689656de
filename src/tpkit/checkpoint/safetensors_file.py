"""The safetensors format as data: parse a header once, read byte ranges of a tensor, write a file.

A safetensors file is an 8-byte little-endian header length, a JSON header `{name: {dtype, shape,
data_offsets}}` (plus an optional `__metadata__`), then the raw row-major bytes. Nothing here unpickles
anything: reading a rank's slice is `os.preadv` of the byte ranges its `ShardLayout` names, straight into the
destination tensor's memory, so a rank never holds more of the file than it needs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
from typing import Callable, Iterable, Mapping, Sequence

import torch

from .errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: where its bytes are (absolute file offsets) and what they hold."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class Header:
    """A parsed file: its tensors by name and its `__metadata__`."""

    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def read_header(path: str) -> Header:
    """Parse `path`'s header and check every tensor's bytes lie inside the file (a truncated file fails here,
    not halfway through a load). Raises CheckpointError naming the file (and the tensor, when one is at fault)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt safetensors header (length {n}, file {size} bytes)")
            raw = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing checkpoint file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    base, tensors = 8 + n, {}
    for name, d in raw.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_info(path, name, d, base, size)
    meta = raw.get("__metadata__") or {}
    return Header(path, tensors, dict(meta) if isinstance(meta, dict) else {})


def _tensor_info(path: str, name: str, d, base: int, size: int) -> TensorInfo:
    try:
        dtype = DTYPES[d["dtype"]]
        shape = tuple(int(s) for s in d["shape"])
        a, b = (int(x) for x in d["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {d!r}") from None
    if b - a != math.prod(shape) * dtype.itemsize or a < 0:
        raise CheckpointError(f"{path}: tensor {name!r}: {b - a} bytes for shape {list(shape)} {d['dtype']}")
    if base + b > size:
        raise CheckpointError(f"{path}: truncated file: tensor {name!r} ends at byte {base + b}, the file has {size}")
    return TensorInfo(name, dtype, shape, base + a, base + b)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (any dtype, bfloat16 included)."""
    return memoryview(t.detach().view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(bytearray())


def read_ranges(path: str, info: TensorInfo, ranges: Iterable[tuple[int, int]], out: torch.Tensor) -> torch.Tensor:
    """Fill the contiguous tensor `out` with the tensor's byte ranges `[a, b)` (relative to its data), in order."""
    pread_runs(path, info.name, [(info.start + a, info.start + b) for a, b in ranges], byte_view(out))
    return out


def pread_runs(path: str, name: str, runs: Iterable[tuple[int, int]], buf: memoryview) -> None:
    """Fill `buf` with the file's byte runs `[a, b)` (absolute offsets), back to back. `name` is the tensor,
    for the error of a truncated file."""
    reads, at = [], 0
    for a, b in runs:
        reads.append((a, [buf[at:at + b - a]]))
        at += b - a
    if at != len(buf):
        raise CheckpointError(f"{path}: tensor {name!r}: {at} bytes to read for a {len(buf)}-byte destination")
    pread_scatter(path, name, reads)


IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024


def pread_scatter(path: str, name: str, reads: Iterable[tuple[int, list[memoryview]]]) -> None:
    """For each `(offset, views)`: fill the views, in order, with the file's bytes from `offset` on. One
    positional read (`os.preadv`) fills many views: a slice that is one run in the file but many in memory
    (a row-split piece) costs one system call, not one per row. `os.preadv` has no shared file position and
    releases the GIL while the kernel copies, so several threads can read one file at once."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, views in reads:
            views, i = [v for v in views if len(v)], 0
            while i < len(views):
                n = os.preadv(fd, views[i:i + IOV_MAX], offset)
                if n <= 0:
                    raise CheckpointError(f"{path}: truncated file while reading tensor {name!r}")
                offset += n
                while i < len(views) and n >= len(views[i]):
                    n -= len(views[i])
                    i += 1
                if n:
                    views[i] = views[i][n:]
    finally:
        os.close(fd)


def write_file(path: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None,
               after_bytes: Callable[[int], None] | None = None) -> dict[str, str]:
    """Write `tensors` as a safetensors file, fsync it and return each tensor's sha256 (of its bytes, hashed as
    written, so the file is not read back). `after_bytes(n)` is called with the bytes written so far (tests
    kill a save halfway with it)."""
    specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    return write_stream(path, specs, tensors.__getitem__, metadata, after_bytes, cumulative=True)


def write_stream(path: str, specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                 produce: Callable[[str], torch.Tensor], metadata: Mapping[str, str] | None = None,
                 after_bytes: Callable[[int], None] | None = None, cumulative: bool = False) -> dict[str, str]:
    """Write a safetensors file whose tensors are made one at a time by `produce(name)` (the header comes
    from `specs` alone), fsync it and return `{name: sha256 of its bytes}`. `after_bytes` gets each tensor's
    byte count (or the running total with `cumulative`)."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    at = 0
    for name, dtype, shape in specs:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digests = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        written = 0
        for name, dtype, shape in specs:
            t = produce(name).detach().contiguous().cpu()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{path}: tensor {name!r} is {t.dtype} {list(t.shape)}, its header says "
                                 f"{dtype} {list(shape)}")
            data = byte_view(t)
            f.write(data)
            digests[name] = sha256_bytes(data)
            written += len(data)
            if after_bytes is not None:
                f.flush()
                after_bytes(written if cumulative else len(data))
        f.flush()
        os.fsync(f.fileno())
    return digests


def sha256_bytes(data: memoryview | torch.Tensor) -> str:
    """sha256 of a buffer, or of a contiguous CPU tensor's bytes (hashlib releases the GIL while hashing)."""
    return hashlib.sha256(byte_view(data) if isinstance(data, torch.Tensor) else data).hexdigest()


def sha256_range(path: str, start: int, stop: int) -> str:
    """sha256 of the file's bytes [start, stop), read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = stop - start
        while left > 0:
            chunk = f.read(min(left, 1 << 22))
            if not chunk:
                raise CheckpointError(f"{path}: truncated file (ends before byte {stop})")
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()
