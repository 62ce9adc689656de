"""load_sharded into a model converted on the meta device (issue 20, item 7): its parameters get memory on the
device asked, its non-persistent buffers (rotary inv_freq) are computed as its class computes them, and its
logits equal the unconverted model's; a model whose buffers cannot be computed is refused before anything
changes, with the fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tpkit
from tests.checkpoint.fixtures import logits_of, meta_load_body, meta_load_each, meta_model, rel
from tests.models.hf import hf_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """llama (GQA, untied) and qwen2 (tied embeddings), saved unconverted, with their logits."""
    out = {}
    for family, over in (("llama", {"num_key_value_heads": 2}), ("qwen2", {})):
        path = tmp_path_factory.mktemp(family)
        model = hf_model(family, **over)
        tpkit.save_sharded(model, str(path))
        out[family] = (str(path), over, logits_of(model))
    return out


@pytest.mark.parametrize("world", [1, 3])
def test_meta_model_loads_exactly_on_threads(saved, world):
    for family, (path, over, ref) in saved.items():
        for err, tied in tpkit.launch(meta_load_body, world, backend="threads", args=(path, family, over, ref)):
            assert err < 1e-6, (family, world, err)
            assert tied == (family == "qwen2")


def test_meta_model_loads_exactly_on_gloo(saved):
    """Both families in one start of the processes."""
    cases = [(path, family, over, ref) for family, (path, over, ref) in saved.items()]
    for per_family in tpkit.launch(meta_load_each, 2, backend="gloo", args=(cases,), timeout=240):
        assert len(per_family) == len(cases)
        for (_, family, _, _), (err, tied) in zip(cases, per_family):
            assert err < 1e-6, (family, err)
            assert tied == (family == "qwen2")


def test_inv_freq_is_computed_not_left_empty(saved):
    """The buffer `to_empty()` leaves uninitialised is the one transformers computes."""
    path, over, _ = saved["llama"]
    model = tpkit.parallelize(meta_model("llama", **over))
    tpkit.load_sharded(model, path)
    want = dict(hf_model("llama", **over).named_buffers())
    got = dict(model.named_buffers())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def test_an_optimizer_built_on_the_meta_model_keeps_its_parameters(saved):
    path, over, ref = saved["qwen2"]
    model = tpkit.parallelize(meta_model("qwen2", **over))
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tpkit.load_sharded(model, path, device="cpu")
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters()))
    assert rel(logits_of(model), ref) < 1e-6


def _load_copy(meta: nn.Module, path: str, ref: torch.Tensor) -> float:
    import copy

    model = tpkit.parallelize(copy.deepcopy(meta))
    tpkit.load_sharded(model, path)
    return rel(logits_of(model), ref)


def test_thread_ranks_load_a_float64_meta_model(tmp_path):
    """Each rank computes the meta model's buffers by building its class, which makes transformers set float64 as
    torch's (process-wide) default while it builds; a rank agreeing meanwhile made its flag in float64 and the
    ranks failed with a CommError (9 runs in 10 before the fix). Built once, deep-copied per rank."""
    model = hf_model("llama", num_key_value_heads=2).double()
    tpkit.save_sharded(model, str(tmp_path))
    ref = logits_of(model)
    with torch.device("meta"):
        meta = type(model)._from_config(model.config, dtype=torch.float64)
    assert torch.get_default_dtype() == torch.float32
    for _ in range(3):
        errors = tpkit.launch(_load_copy, 2, backend="threads", args=(meta, str(tmp_path), ref), timeout=120)
        assert max(errors) < 1e-12, errors
    assert torch.get_default_dtype() == torch.float32


class Rotary(nn.Module):
    """Not a Hugging Face model: nothing can recompute its buffer."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("freq", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.proj(x) * self.freq


def test_buffers_nobody_can_compute_are_refused_before_anything_changes(tmp_path):
    tpkit.save_sharded(Rotary(), str(tmp_path))
    with torch.device("meta"):
        model = Rotary()
    with pytest.raises(tpkit.CheckpointError, match=r"freq.*meta device.*from_pretrained") as info:
        tpkit.load_sharded(model, str(tmp_path))
    assert str(tmp_path) in str(info.value)
    assert model.proj.weight.is_meta and model.freq.is_meta


def test_meta_parameters_missing_from_the_checkpoint_are_refused(tmp_path):
    """A meta parameter the checkpoint lacks is refused (strict or not: nothing would fill it)."""
    from safetensors.torch import save_file

    save_file({"proj.weight": torch.ones(4, 4)}, str(tmp_path / "m.safetensors"))
    with torch.device("meta"):
        model = nn.Sequential()
        model.proj = nn.Linear(4, 4)
    with pytest.raises(tpkit.CheckpointError, match=r"lacks.*proj.bias"):
        tpkit.load_sharded(model, str(tmp_path / "m.safetensors"), strict=False)
    assert model.proj.weight.is_meta
