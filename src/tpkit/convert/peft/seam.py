"""The one place tpkit meets PEFT (Hugging Face's adapter library), and everything it changes there.

A tensor-parallel model needs three things of PEFT, each through the narrowest point PEFT offers:
1. its LoRA dispatch builds tpkit's LoRA layers on tpkit's split layers (`tpkit.nn.lora`): PEFT's own extension
   point, the custom-module mapping of a `LoraConfig` (`_register_custom_module`), filled into any config PEFT
   dispatches a tpkit layer with (`LoraModel._create_new_module`, wrapped), so stock configs and the configs
   `PeftModel.from_pretrained` reads from a file work;
2. `PeftModel.save_pretrained`, called on every rank, writes the files one process writes (`adapter_state_dict`:
   PEFT's own selection of tensors, each gathered to full size by its layout, plus the base weights of targeted
   embeddings and heads PEFT saves but does not recognise on tpkit's layers; world rank 0 writes through PEFT into a
   temporary directory whose files are then renamed into place, so a reader never sees half a file);
3. `set_peft_model_state_dict` (what `PeftModel.from_pretrained` / `load_adapter` load through) gives each rank its
   slices of a stock file's full-size tensors (a `modules_to_save` copy split as its original; the LoRA layers cut
   their own factors), and refuses, before anything loads, a file whose tensors are not this model's full shapes
   (an adapter made for another model), naming both.
Each wrap passes every call that involves no tpkit model to PEFT unchanged.

`install()` puts them in; tpkit's entry points call it (`parallelize`, so `from_pretrained`; `lora_config`). PEFT
is never imported for it: where PEFT's modules are loaded already they are wrapped at once, and otherwise as they
load (an import hook for exactly those modules), so the order of `import peft` and tpkit's calls changes nothing.

Tested with PEFT `TESTED_PEFT` (constraints.txt pins it): a tpkit model meeting another release raises
`PeftVersionError` before PEFT touches it (`TPKIT_PEFT_UNTESTED=1` lets it through).
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import threading
import weakref
from typing import Any, Callable

import torch
from torch import nn

from ...comm.communicator import Communicator
from ...comm.rebind import root_of
from ...layout import ShardLayout
from ...nn.full_tensors import gather_full
from ...nn.record import communicator_of
from ..layouts import shard_layouts

TESTED_PEFT = ("0.21",)  # release series the seam was written and tested against
_LOCK = threading.Lock()
_WRAPPED: set[str] = set()


class PeftVersionError(RuntimeError):
    """A tpkit model met a PEFT release the seam was not tested with."""


PEFT_MODEL, TUNER = "peft.peft_model.PeftModel", "peft.tuners.tuners_utils.BaseTuner"
TUNER_LAYER, SAVED_COPY = "peft.tuners.tuners_utils.BaseTunerLayer", "peft.utils.other.ModulesToSaveWrapper"
_KINDS: "weakref.WeakKeyDictionary[type, frozenset[str]]" = weakref.WeakKeyDictionary()


def peft_kinds(cls: type) -> frozenset[str]:
    """The PEFT classes (`module.name`) a class is an instance of, known by name (PEFT is not imported for it: no PEFT
    object exists unless PEFT is); read once per class, as a model holds many modules of few classes."""
    kinds = _KINDS.get(cls)
    if kinds is None:
        kinds = _KINDS[cls] = frozenset(f"{c.__module__}.{c.__name__}" for c in cls.__mro__
                                        if c.__module__.startswith("peft."))
    return kinds


def check_version() -> None:
    """Raise `PeftVersionError` unless the installed PEFT is a tested release (or TPKIT_PEFT_UNTESTED=1)."""
    import peft

    version = getattr(peft, "__version__", "?")
    if os.environ.get("TPKIT_PEFT_UNTESTED") == "1" or any(version == s or version.startswith(s + ".")
                                                            for s in TESTED_PEFT):
        return
    raise PeftVersionError(f"tpkit's PEFT support was tested with PEFT {', '.join(s + '.x' for s in TESTED_PEFT)}; "
                           f"this process has PEFT {version}, whose LoRA dispatch, adapter files or loading may "
                           f"differ. Install the tested release (pip install 'tpkit[lora]'), or set "
                           f"TPKIT_PEFT_UNTESTED=1 to try this one")


# --------------------------------------------------------------------------------------------------- install

def install() -> None:
    """Put the seam into PEFT: now for PEFT modules already loaded, else when they load (idempotent)."""
    with _LOCK:
        for name, wrap in _WRAPS.items():
            module = sys.modules.get(name)
            if module is not None and name not in _WRAPPED:
                wrap(module)
                _WRAPPED.add(name)
        if not all(n in _WRAPPED for n in _WRAPS) and not any(isinstance(f, _WrapOnLoad) for f in sys.meta_path):
            sys.meta_path.insert(0, _WrapOnLoad())


class _WrapOnLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the PEFT modules the seam wraps, it lets the other finders find them and wraps the
    module once it has executed."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in _WRAPS or fullname in _WRAPPED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, fullname)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name: str):
        self.inner, self.name = inner, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        with _LOCK:
            if self.name not in _WRAPPED:
                _WRAPS[self.name](module)
                _WRAPPED.add(self.name)


def _tpkit_layer(target: nn.Module) -> bool:
    from ...nn.lora import LORA_LAYERS

    base = target.get_base_layer() if hasattr(target, "get_base_layer") else target
    return isinstance(base, tuple(LORA_LAYERS))


def _wrap_dispatch(module) -> None:
    """(1) A tpkit layer's LoRA layer comes from PEFT's custom-module dispatch: the config it dispatches with gets
    tpkit's mapping first."""
    cls = module.LoraModel
    original = cls._create_new_module

    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        if _tpkit_layer(target):
            from ...nn.lora import register

            check_version()
            register(lora_config)
        return original(lora_config, adapter_name, target, **kwargs)

    _create_new_module.tpkit_original = original  # type: ignore[attr-defined]
    cls._create_new_module = staticmethod(_create_new_module)


def _wrap_files(module) -> None:
    """(2) and (3): stock files from and onto a tensor-parallel model."""
    save, load = module.PeftModel.save_pretrained, module.set_peft_model_state_dict

    @functools.wraps(save)
    def save_pretrained(self, save_directory: str, *args: Any, **kwargs: Any) -> None:
        comm = communicator_of(self)
        if comm is None or comm.world_size == 1 or kwargs.get("state_dict") is not None or args:
            return save(self, save_directory, *args, **kwargs)
        kwargs.pop("state_dict", None)  # None: Trainer passes it explicitly
        check_version()
        adapters = kwargs.get("selected_adapters") or list(self.peft_config)
        full = adapter_state_dict(self, adapters, kwargs.get("save_embedding_layers", "auto"), comm)
        world = root_of(comm)  # every rank calls it; one writes (data-parallel replicas hold the same adapter)
        if world.rank == 0 and kwargs.get("is_main_process", True):
            parent = os.path.dirname(os.path.abspath(save_directory)) or "."
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(save_directory)}.tmp-")
            try:
                save(self, tmp, state_dict=full, **kwargs)
                for adapter in adapters:  # what PEFT's own selection leaves out on tpkit's layers
                    _add_to_file(tmp if adapter == "default" else os.path.join(tmp, adapter), {
                        k: full[k] for k in _embedding_bases(self, adapter, kwargs.get("save_embedding_layers",
                                                                                         "auto"), full)})
                _move_into(tmp, save_directory)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        world.barrier()

    @functools.wraps(load)
    def set_peft_model_state_dict(model, *args: Any, **kwargs: Any):
        comm = communicator_of(model)
        if comm is None or comm.world_size == 1:
            return load(model, *args, **kwargs)
        check_version()
        adapter = kwargs.get("adapter_name", args[1] if len(args) > 1 else "default")
        config = getattr(model, "peft_config", {}).get(adapter)
        made_for = getattr(config, "base_model_name_or_path", None)
        handle = model.register_load_state_dict_pre_hook(_full_to_local(shard_layouts(model), made_for,
                                                                        getattr(model, "name_or_path", None)))
        try:
            return load(model, *args, **kwargs)
        finally:
            handle.remove()

    save_pretrained.tpkit_original = save  # type: ignore[attr-defined]
    set_peft_model_state_dict.tpkit_original = load  # type: ignore[attr-defined]
    module.PeftModel.save_pretrained = save_pretrained
    module.set_peft_model_state_dict = set_peft_model_state_dict


_WRAPS: dict[str, Callable[[Any], None]] = {"peft.tuners.lora.model": _wrap_dispatch, "peft.peft_model": _wrap_files}


# --------------------------------------------------------------------------------------------------- the pieces

def lora_config(**kwargs: Any):
    """A `peft.LoraConfig(**kwargs)` with tpkit's LoRA layers in its custom-module mapping (the seam installed). A
    stock `LoraConfig` works as well; this one also says so in code."""
    install()
    from peft import LoraConfig

    from ...nn.lora import register

    check_version()
    return register(LoraConfig(**kwargs))


def adapter_state_dict(model: nn.Module, adapters: list[str], save_embedding_layers: Any = "auto",
                       comm: Communicator | None = None) -> dict[str, torch.Tensor]:
    """`{model state_dict key: full tensor}` of what PEFT saves for `adapters` (collective)."""
    from peft.utils import get_peft_model_state_dict

    local = model.state_dict()
    key_of = {id(v): k for k, v in local.items()}
    keys: dict[str, None] = {}
    for adapter in adapters:
        picked = get_peft_model_state_dict(model, state_dict=local, adapter_name=adapter,
                                           save_embedding_layers=save_embedding_layers)
        for saved, t in picked.items():
            if id(t) not in key_of:
                raise ValueError(f"save_pretrained: PEFT saves {saved!r} as a tensor the model's state dict does not "
                                 f"hold; tpkit cannot tell which part of it this rank holds")
            keys[key_of[id(t)]] = None
        keys.update(dict.fromkeys(_embedding_bases(model, adapter, save_embedding_layers, local)))
    layouts = shard_layouts(model)
    comm = comm or communicator_of(model)
    return {k: gather_full(local[k], layouts[k], comm) for k in local if k in keys}


def _embedding_bases(model: nn.Module, adapter: str, save_embedding_layers: Any, local: dict) -> list[str]:
    """The base weights of LoRA-wrapped embeddings PEFT also saves (`save_embedding_layers`: True, or "auto" with an
    embedding among the targets), which PEFT's own check skips on tpkit's split embeddings and heads (it asks for
    `nn.Embedding` / `nn.Linear` bases): the keys under `<wrapper>.base_layer.` of the input and output embeddings."""
    from peft.utils.constants import EMBEDDING_LAYER_NAMES

    from ...nn.lora import LORA_LAYERS

    config = model.peft_config[adapter]
    targets = getattr(config, "target_modules", None) or ()
    targeted = any(re.search(rf"(^|\.){e}$", n) for n, _ in model.named_modules() for e in EMBEDDING_LAYER_NAMES
                   if (re.fullmatch(targets, n) if isinstance(targets, str) else any(n == t or n.endswith("." + t)
                                                                                   for t in targets)))
    if getattr(config, "trainable_token_indices", None) is not None or save_embedding_layers is False or \
            not targeted or not hasattr(model, "get_input_embeddings"):
        return []
    wrappers = {id(m.base_layer): n for n, m in model.named_modules()
                if isinstance(getattr(m, "base_layer", None), tuple(LORA_LAYERS))}
    names = [wrappers.get(id(getattr(layer, "base_layer", None))) for layer in
             (model.get_input_embeddings(), model.get_output_embeddings())]
    return [k for n in names if n for k in local if k.startswith(f"{n}.base_layer.")]


def _add_to_file(directory: str, tensors: dict[str, torch.Tensor]) -> None:
    """Add `tensors` to the adapter file PEFT wrote in `directory` (a temporary one), keeping its metadata."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = os.path.join(directory, "adapter_model.safetensors")
    if not tensors or not os.path.exists(path):
        return
    with safe_open(path, "pt") as f:
        held, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file({**held, **{k: v.contiguous() for k, v in tensors.items()}}, path, metadata=metadata)


def _move_into(src: str, dst: str) -> None:
    """Every file under `src` renamed to the same place under `dst` (each replaced atomically)."""
    for root, _, files in os.walk(src):
        target = os.path.join(dst, os.path.relpath(root, src))
        os.makedirs(target, exist_ok=True)
        for f in files:
            os.replace(os.path.join(root, f), os.path.join(target, f))


def _full_to_local(layouts: dict[str, ShardLayout], made_for: str | None, model_name: str | None):
    """A load pre-hook for a whole model, for a stock adapter file (full-size tensors): each tensor of a split key is
    replaced by this rank's slice. A tensor whose shape is not the full tensor's (an adapter made for another model)
    is refused before anything is copied, naming the full shapes: a rank's slice may happen to have the shape of
    another model's tensor, and would load silently wrong."""
    def hook(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        wrong = []
        for key, t in list(state_dict.items()):
            lay = layouts.get(key[len(prefix):]) if key.startswith(prefix) else None
            if lay is None or not isinstance(t, torch.Tensor):
                continue
            if tuple(t.shape) != tuple(lay.full_shape):
                wrong.append(f"{key[len(prefix):]}: the file holds {list(t.shape)}, this model {list(lay.full_shape)}")
            elif not lay.is_replicated and tuple(lay.full_shape) != tuple(lay.local_shape):
                state_dict[key] = lay.shard(t)
        if wrong:
            raise ValueError(f"the adapter does not fit this model (full shapes, all ranks together): "
                             f"{'; '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}. It was made for "
                             f"{made_for or 'a model it does not name'}; this model is {model_name or 'unnamed'}. "
                             f"Load an adapter trained on this model")
    return hook
