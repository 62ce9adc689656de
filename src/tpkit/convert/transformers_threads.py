"""transformers from thread-ranks: its names resolved once under a lock, its model builds one at a time.

Thread-ranks (`run_threads`, `launch(..., backend="threads")`) share one process, and two things of
transformers are process-wide:

- Its lazy module. The first `transformers.AutoConfig` imports `transformers.models.auto` and what that
  imports. Two threads doing that at once can each hold one module of an import cycle; Python breaks the
  deadlock by handing one thread the other's half-initialised module, and the lookup fails with "module
  'transformers' has no attribute 'AutoConfig'" (`from_pretrained` on thread-ranks failed so unless the main
  thread had used the name first). `transformers_name` resolves each name the first time under one lock.
- torch's default dtype, which a build sets. transformers' `from_config` / `_from_config` set it to the
  config's or the `dtype=` argument's dtype for the build and restore it after (`local_torch_dtype`): passing
  `dtype=` to transformers switches it process-wide just as `torch.set_default_dtype` does, so the switch
  cannot be avoided, only kept apart. `building` runs one build at a time, so two builds never restore each
  other's value (parameters in the wrong dtype, or a default left switched for good); tensors tpkit makes
  for a collective carry an explicit dtype, so a rank communicating meanwhile is not affected.
"""
from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any, Iterator

import torch

_NAMES_LOCK = threading.RLock()  # reentrant: resolving one name may run code that resolves another here
_NAMES: dict[tuple[str, str], Any] = {}
_BUILD_LOCK = threading.RLock()  # reentrant: a build may build a part the same way (computed buffers)


def transformers_name(name: str, module: str = "") -> Any:
    """`transformers.<name>`, or `transformers.<module>.<name>` with `module` (e.g. "pytorch_utils", "Conv1D").

    Raises ImportError (transformers missing) or AttributeError as a plain import would."""
    key = (module, name)
    found = _NAMES.get(key)
    if found is not None:
        return found
    with _NAMES_LOCK:
        found = _NAMES.get(key)
        if found is None:
            package = importlib.import_module(f"transformers.{module}") if module else \
                importlib.import_module("transformers")
            found = _NAMES[key] = getattr(package, name)
    return found


def config_dtype(config) -> torch.dtype | None:
    """The dtype a transformers config names (`dtype`; `torch_dtype` in configs written before transformers 4.56),
    as a torch.dtype; None when it names none (or a name torch does not know). What `from_pretrained(dtype="auto")`
    loads in, and so the dtype a checkpoint's floating tensors (a quantized layer's scales among them) are stored in."""
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found, None)
    return found if isinstance(found, torch.dtype) else None


@contextlib.contextmanager
def building(dtype: torch.dtype | None = None) -> Iterator[None]:
    """Hold while building a model: one build at a time in this process, with `dtype` as torch's default
    inside when it is a floating dtype (None: the default unchanged, transformers may still set it), and the
    default restored after."""
    with _BUILD_LOCK:
        saved = torch.get_default_dtype()
        try:
            if dtype is not None and dtype.is_floating_point:
                torch.set_default_dtype(dtype)
            yield
        finally:
            torch.set_default_dtype(saved)
