"""The tpkit checkpoint directory: versioned subdirectories, a `latest` pointer, one JSON manifest each.

```
DIR/latest                       "v000002-step-000000123" (replaced atomically by os.replace)
DIR/v000002-step-000000123/      manifest.json + rank-00000.safetensors, rank-00001.safetensors, ...
```
A save writes a new version directory and only then moves `latest`, so a save killed midway leaves the pointer
(and the version it names) untouched. A version is complete once its manifest exists (rank 0 writes it after every
rank's file is written and fsynced); one without is the remains of a save that died, and the next successful save
removes it (`prune`), with the complete versions beyond the newest `keep` when asked to. A version is removed by
renaming it out of the version namespace first (`.trash-*`), so a removal killed midway never leaves a
half-deleted directory that still looks like a version. The manifest records, for every key, the full shape, dtype and
the pieces (file, tensor name, offsets in the full tensor, sha256 of its bytes); plus the files with their sizes,
step, extra, the model config and plan, optimizer hyperparameters, and RNG tracker states. Nothing is pickled.
Manifests of format version 1 hashed whole files instead (`check_checksums`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid

from .errors import CheckpointError

FORMAT = "tpkit-checkpoint"
MANIFEST = "manifest.json"
LATEST = "latest"
_VERSION = re.compile(r"^v(\d{6})")
TRASH = ".trash-"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def next_version(directory: str, step: int | None) -> str:
    """The next version directory name under `directory` (called on one rank and broadcast)."""
    numbers = [int(m.group(1)) for n in (os.listdir(directory) if os.path.isdir(directory) else [])
               if (m := _VERSION.match(n))]
    name = f"v{max(numbers, default=-1) + 1:06d}"
    return name if step is None else f"{name}-step-{int(step):09d}"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, data: dict) -> None:
    """Write `data` to `path` durably: a temporary file, fsync, os.replace, fsync of the directory."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def point_latest(directory: str, version: str) -> None:
    """Move `latest` to `version` atomically (the last step of a save)."""
    tmp = os.path.join(directory, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(version + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, LATEST))
    fsync_dir(directory)


def versions(directory: str) -> list[tuple[int, str, bool]]:
    """`(number, name, complete)` of every version directory under `directory`, oldest first; complete means it
    has its manifest."""
    out = []
    for name in (os.listdir(directory) if os.path.isdir(directory) else []):
        m = _VERSION.match(name)
        if m and os.path.isdir(os.path.join(directory, name)):
            out.append((int(m.group(1)), name, os.path.exists(os.path.join(directory, name, MANIFEST))))
    return sorted(out)


def read_latest(directory: str) -> str | None:
    """The version name `latest` holds, or None."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def remove_version(directory: str, name: str) -> None:
    """Remove version `name`: renamed out of the version namespace (atomic), then deleted."""
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return
    trash = os.path.join(directory, f"{TRASH}{name}-{uuid.uuid4().hex[:8]}")
    os.replace(path, trash)
    fsync_dir(directory)
    shutil.rmtree(trash, ignore_errors=True)


def prune(directory: str, keep: int | None, current: str) -> list[str]:
    """After version `current` was saved: remove partial versions older than it, the complete ones beyond the
    newest `keep` (all kept when None; never `current` or what `latest` names), and leftovers of removals that
    were killed. Returns the names removed."""
    latest = read_latest(directory)
    found = versions(directory)
    number = next((n for n, name, _ in found if name == current), None)
    complete = [name for _, name, ok in found if ok]
    doomed = [name for n, name, ok in found if not ok and number is not None and n < number]
    if keep is not None:
        doomed += [name for name in complete[:-keep] if name not in (current, latest)]
    for name in doomed:
        remove_version(directory, name)
    for name in os.listdir(directory):
        if name.startswith(TRASH):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return doomed


def find_version(path: str) -> str | None:
    """The version directory `path` names: a checkpoint root (follows `latest`), a version directory, or its
    manifest. None when `path` is no tpkit checkpoint."""
    if os.path.isfile(path):
        return os.path.dirname(path) if os.path.basename(path) == MANIFEST else None
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    pointer = os.path.join(path, LATEST)
    if os.path.exists(pointer):
        with open(pointer) as f:
            version = os.path.join(path, f.read().strip())
        if not os.path.exists(os.path.join(version, MANIFEST)):
            raise CheckpointError(f"{pointer}: names {version}, which has no {MANIFEST}")
        return version
    return None


def read_manifest(version: str) -> dict:
    path = os.path.join(version, MANIFEST)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or "tensors" not in data:
        raise CheckpointError(f"{path}: not a tpkit checkpoint manifest")
    return data


def sha256_file(path: str) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def check_checksums(version: str, manifest: dict, rank: int, world: int) -> None:
    """Compare the sha256 of this rank's share of the files (every `world`-th, so each file is hashed once in
    all) with the manifest's; raise CheckpointError naming the first file that differs."""
    for i, (name, d) in enumerate(sorted(manifest.get("files", {}).items())):
        if i % world != rank:
            continue
        path = os.path.join(version, name)
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: missing checkpoint file")
        if sha256_file(path) != d.get("sha256"):
            raise CheckpointError(f"{path}: sha256 differs from the manifest's (the file changed or is damaged)")
