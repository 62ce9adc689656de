"""transformers' names, each resolved once under a lock, so thread-ranks can use them.

Thread-ranks (`run_threads`, `launch(..., backend="threads")`) share one process, and transformers' lazy module
with it. The first `transformers.AutoConfig` imports `transformers.models.auto` and what that imports. Two
threads doing that at once can each hold one module of an import cycle; Python breaks the deadlock by handing
one thread the other's half-initialised module, and the lookup fails with "module 'transformers' has no
attribute 'AutoConfig'" (`from_pretrained` on thread-ranks failed so unless the main thread had used the name
first). `transformers_name` resolves each name the first time under one lock.
"""
from __future__ import annotations

import importlib
import threading
from typing import Any

_NAMES_LOCK = threading.RLock()  # reentrant: resolving one name may run code that resolves another here
_NAMES: dict[tuple[str, str], Any] = {}


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

