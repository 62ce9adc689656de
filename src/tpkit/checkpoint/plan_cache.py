"""Plans `from_pretrained` decided before, kept on disk and applied as recorded: a reload skips the trace and dry run.

Why: deciding the plan of a Hugging Face directory's model is most of a load that is not reading. At TP2 on a
0.64 GB Llama (the first load in a fresh process, 2-core box): the trace 24 ms and the dry run 39 ms of 160 ms,
against 30-55 ms of reading. A tpkit checkpoint already carries the plan it was saved with and is applied as
recorded (`pretrained.recorded_plan`); this does the same for the plans tpkit decided itself, the second time the
same model is loaded the same way.

A plan is a function of what the model is and how it is converted, so the key is a SHA-256 over all of it:
- the model's classes: the file (path, size, modification time) of every module along each class's MRO, and where
  each `forward` is defined (an edited or patched model is new; a class without a file, from a notebook, is never
  cached);
- the config (every field but the path it came from), the dtype and transformers' build keywords;
- the checkpoint's tensors (name, dtype, shape);
- the world size, the mode and `reuse`;
- torch's and transformers' versions, and every tpkit source file's path, size and modification time (another
  tpkit, even an edited checkout, decides anew);
- every `TPKIT_*` / `TP_*` environment variable.

Only `plan="auto"` on a dense checkpoint through `parallelize` is cached (a quantized checkpoint, a plan of the
user's, a pipeline's `convert` decide as before). Files: `<cache root>/plans/<key>.json` (`quant.native.cache_root`:
`$TPKIT_CACHE`, default `~/.cache/tpkit`), the plan's `to_dict()` as JSON, written atomically by rank 0 after a
conversion (unless the model's forward replaced some of its modules meanwhile: `Plan.replaced_by_forward`) and
read with `json` only.
Every rank reads its own; the plan is used only when every rank found the same file under the same key (one
all-gather of a digest of both, made whatever each rank's switch), else all decide it. A cached plan whose
conversion fails is deleted before the error goes on (the next load decides anew). `TPKIT_PLAN_CACHE=0` turns the
cache off.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
from torch import nn

from ..comm.profiler import write_atomically
from ..convert.plan import Plan
from ..quant.native import cache_root

_CODE: list[str] = []  # the fingerprint of tpkit's own files, once per process (they do not change under it)


def enabled() -> bool:
    return os.environ.get("TPKIT_PLAN_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def _stat(path: str | None) -> list:
    try:
        st = os.stat(path) if path else None
    except OSError:
        st = None
    return [path, st.st_size, st.st_mtime_ns] if st is not None else [path]


def _code() -> str:
    if not _CODE:
        import transformers

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names
                       if f.endswith((".py", ".c")))
        text = json.dumps([torch.__version__, transformers.__version__] + [_stat(f) for f in files])
        _CODE.append(hashlib.sha256(text.encode()).hexdigest())
    return _CODE[0]


def _class_code(classes: set[type]) -> list | None:
    """What decides the classes' code: the file of every module along each class's MRO, and where each `forward` is
    defined (a forward patched in from elsewhere moves it); None when one has no file (a notebook, `python -c`)."""
    out = []
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
        for base in cls.__mro__[:-1]:
            path = getattr(sys.modules.get(base.__module__), "__file__", None)
            if path is None and not base.__module__.startswith(("torch", "builtins")):
                return None
            out.append([base.__module__, base.__qualname__] + _stat(path))
        code = getattr(getattr(cls, "forward", None), "__code__", None)
        out.append([code.co_filename, code.co_firstlineno] if code is not None else None)
    return out


def key(model: nn.Module, config, source, dtype: torch.dtype, build_kwargs: dict, world: int, mode: str,
        reuse: bool | None) -> str | None:
    """The cache key of converting the meta-built `model` (see the module doc for what it covers); None when its
    code cannot be told apart from an edited one (a class without a source file)."""
    classes = _class_code({type(m) for m in model.modules()})
    if classes is None:
        return None
    settings = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "name_or_path")}
    tensors = sorted((k, str(e.dtype), list(e.shape)) for k, e in source.entries.items())
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("TPKIT_", "TP_")))
    parts = [_code(), classes, settings, str(dtype), build_kwargs, tensors, world, mode, reuse, env]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def path_of(cache_key: str) -> str:
    return os.path.join(cache_root(), "plans", f"{cache_key}.json")


def read(cache_key: str, world: int, mode: str) -> tuple[Plan, int] | None:
    """(the plan stored under `cache_key`, a 60-bit digest of the key and the file's bytes), or None (none stored,
    unreadable, or not for this world size and mode)."""
    try:
        with open(path_of(cache_key), "rb") as f:
            data = f.read()
        plan = Plan.from_dict(json.loads(data))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    digest = int(hashlib.sha256(cache_key.encode() + data).hexdigest()[:15], 16)
    return (plan, digest) if plan.world_size == world and plan.mode == mode and plan.entries else None


def agreed(comm, found: tuple[Plan, int] | None) -> Plan | None:
    """The plan found where every rank found the same one (the same key and bytes), else None on every rank
    (collective: every rank calls it, with None where its cache is off or has nothing)."""
    if comm.world_size == 1:
        return found[0] if found is not None else None
    mine = found[1] if found is not None else -1
    every = comm.all_gather(torch.tensor([mine], dtype=torch.int64)).tolist()
    return found[0] if found is not None and len(set(every)) == 1 else None


def lookup(model: nn.Module, config, source, dtype: torch.dtype, build_kwargs: dict, comm, mode: str,
           reuse: bool | None) -> tuple[Plan | str, bool, str | None]:
    """(the plan to convert with, whether it is applied as recorded, the key to store the plan under or None) for
    `from_pretrained`'s "auto": the stored plan where every rank found the same, else "auto". Collective: every rank
    calls it, whatever its `TPKIT_PLAN_CACHE`, so ranks that disagree on the switch still meet."""
    cache_key = key(model, config, source, dtype, build_kwargs, comm.world_size, mode, reuse) if enabled() else None
    found = agreed(comm, read(cache_key, comm.world_size, mode) if cache_key is not None else None)
    return (found, True, cache_key) if found is not None else ("auto", False, cache_key)


def write(cache_key: str, plan: Plan) -> None:
    """Store `plan` under `cache_key` (atomically; a cache that cannot be written is no error)."""
    try:
        os.makedirs(os.path.dirname(path_of(cache_key)), exist_ok=True)
        write_atomically(path_of(cache_key), json.dumps(plan.to_dict()))
    except Exception:  # noqa: BLE001 - rank 0 alone writes: nothing here may raise on it and not the others
        pass


def forget(cache_key: str, error: BaseException) -> None:
    """Delete the plan stored under `cache_key` after its conversion failed, and say so on `error`."""
    try:
        os.unlink(path_of(cache_key))
    except OSError:
        pass
    error.add_note(f"tpkit: the plan came from the plan cache ({path_of(cache_key)}), now deleted: the next load "
                   f"decides it anew; TPKIT_PLAN_CACHE=0 turns the cache off")
