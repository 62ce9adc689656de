"""Shared pieces of the checkpoint tests: tiny Hugging Face directories written by `save_pretrained`, their
reference logits from transformers' own loader, and the per-rank bodies (module level, so gloo processes can
import them)."""
from __future__ import annotations

import os

import torch

from tests.models.hf import hf_model, inputs

# name -> (family, overrides, save_pretrained kwargs): GQA Llama, fused-qkv NeoX, fused qkv + gate_up Phi-3
# (the last as an index + shards).
MODELS = {
    "llama": ("llama", {"num_key_value_heads": 2}, {}),
    "neox": ("neox", {}, {}),
    "phi3": ("phi3", {}, {"max_shard_size": "50KB"}),
}


def mlp(seed: int = 0) -> torch.nn.Module:
    """A small MLP (column -> relu -> row at TP 2): the model of process tests that need no transformers, whose
    import is most of a spawned rank's start on a busy box."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))


def write_hf(root: str, name: str) -> str:
    family, over, kw = MODELS[name]
    path = os.path.join(root, name)
    hf_model(family, **over).save_pretrained(path, **kw)
    return path


def hf_logits(path: str) -> torch.Tensor:
    import transformers

    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(path)(input_ids=inputs()).logits


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.detach().float() - b.float()).abs().max() / b.float().abs().max()).item()


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=inputs()).logits


def pretrained_and_save_body(paths: dict, refs: dict, out: str) -> dict:
    """On each rank: from_pretrained every directory, compare logits, save_sharded under `out/<name>`."""
    import tpkit

    errs = {}
    for name, path in paths.items():
        model = tpkit.from_pretrained(path)
        errs[name] = rel(logits_of(model), refs[name])
        tpkit.save_sharded(model, os.path.join(out, name), step=7, extra={"name": name})
    return errs


def killed_save_body(root: str) -> None:
    """Save once, change the weights, and start a second save that SIGKILLs this rank halfway through its file."""
    import signal

    import tpkit
    from tpkit.checkpoint import save

    model = tpkit.parallelize(hf_model("llama"))
    tpkit.save_sharded(model, root, step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def die(nbytes: int) -> None:
        if nbytes > 4096:
            os.kill(os.getpid(), signal.SIGKILL)

    save.WRITE_HOOK = die
    tpkit.save_sharded(model, root, step=2)


def meta_model(family: str, **over):
    """The tiny model `family`, built entirely on the meta device (buffers included), as
    `with torch.device("meta")` builds it."""
    from tests.models.hf import hf_model

    config = hf_model(family, **over).config
    with torch.device("meta"):
        return type(hf_model(family, **over))._from_config(config)


def meta_load_body(directory: str, family: str, over: dict, ref: torch.Tensor) -> tuple[float, bool]:
    """On each rank: convert a model built on the meta device, load_sharded into it, compare logits; and
    whether tied weights stayed one tensor."""
    import tpkit

    model = tpkit.parallelize(meta_model(family, **over))
    tpkit.load_sharded(model, directory)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return rel(logits_of(model), ref), tied


def meta_load_each(cases: list) -> list[tuple[float, bool]]:
    """`meta_load_body` of each of `cases` (its arguments), one after the other on the same ranks."""
    return [meta_load_body(*case) for case in cases]
