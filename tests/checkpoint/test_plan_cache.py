"""The plan cache of `from_pretrained` (`checkpoint/plan_cache.py`): a reload applies the plan decided the first
time without tracing, and the model equals transformers' one-process load (logits, and gradients in training mode)
at 2 and 3 ranks; what the key covers; unreadable, stale and disagreeing entries; the switch. The suite runs with
the cache off (tests/conftest.py): these tests turn it on, in a temporary directory."""
from __future__ import annotations

import glob
import importlib
import json
import os

import pytest
import torch

import tpkit
from tests.checkpoint.fixtures import hf_logits, logits_of, rel, write_hf
from tests.models.hf import inputs
from tpkit.checkpoint import plan_cache


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = write_hf(str(tmp_path_factory.mktemp("hf")), "llama")
    return path, hf_logits(path)


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TPKIT_PLAN_CACHE", "1")
    monkeypatch.setenv("TPKIT_CACHE", str(tmp_path))
    return tmp_path / "plans"


@pytest.fixture
def traced(monkeypatch):
    """How many times a rank traced a model (the step a cached plan skips)."""
    decide = importlib.import_module("tpkit.convert.planning.decide")
    calls, real = [], decide._traced
    monkeypatch.setattr(decide, "_traced", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _load(path, ref, **kw):
    model = tpkit.from_pretrained(path, progress=False, **kw)
    return rel(logits_of(model), ref), model.tp_plan.to_dict()


def test_a_reload_applies_the_stored_plan_without_tracing(llama, cache, traced):
    path, ref = llama
    first = tpkit.launch(_load, 2, backend="threads", args=(path, ref))
    assert len(traced) == 2 and len(os.listdir(cache)) == 1
    second = tpkit.launch(_load, 2, backend="threads", args=(path, ref))
    assert len(traced) == 2  # nothing traced the second time
    for (err1, plan1), (err2, plan2) in zip(first, second):
        assert err1 < 1e-5 and err2 < 1e-5 and plan1 == plan2
    for _ in range(2):  # another world size is another key: decided (traced) once, then read
        for err, _ in tpkit.launch(_load, 3, backend="threads", args=(path, ref)):
            assert err < 1e-5
    assert len(traced) == 5 and len(os.listdir(cache)) == 2


def _train_step(path, full_grads):
    model = tpkit.from_pretrained(path, mode="training", progress=False)
    model(input_ids=inputs()).logits.pow(2).mean().backward()
    layouts = tpkit.shard_layouts(model)
    return max(rel(p.grad, layouts[n].shard(full_grads[n])) for n, p in model.named_parameters())


def test_a_cached_training_plan_gives_transformers_gradients(llama, cache, traced):
    import transformers

    path, _ = llama
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    hf(input_ids=inputs()).logits.pow(2).mean().backward()
    full = {n: p.grad for n, p in hf.named_parameters()}
    for round_ in range(2):
        for err in tpkit.launch(_train_step, 3, backend="threads", args=(path, full)):
            assert err < 1e-5, (round_, err)
    assert len(traced) == 3  # the first round decided the plan; the second read it


def test_the_key_covers_what_decides_the_plan(llama, cache, monkeypatch):
    from tpkit.checkpoint.load import open_source
    from tpkit.checkpoint.pretrained import build, load_config

    path, _ = llama
    source = open_source(path, 0, 1)
    config = load_config(source, path)
    model = build(config, None, torch.float32)
    args = dict(model=model, config=config, source=source, dtype=torch.float32, build_kwargs={}, world=2,
                mode="inference", reuse=None)
    base = plan_cache.key(**args)
    assert plan_cache.key(**args) == base
    changed = [plan_cache.key(**dict(args, world=3)), plan_cache.key(**dict(args, mode="training")),
               plan_cache.key(**dict(args, dtype=torch.bfloat16)), plan_cache.key(**dict(args, reuse=False)),
               plan_cache.key(**dict(args, build_kwargs={"attn_implementation": "eager"}))]
    other = load_config(source, path)
    other.rms_norm_eps = 1e-3
    changed.append(plan_cache.key(**dict(args, config=other)))
    monkeypatch.setenv("TPKIT_PLAN_REUSE", "0")
    changed.append(plan_cache.key(**args))
    monkeypatch.delenv("TPKIT_PLAN_REUSE")
    monkeypatch.setattr(plan_cache, "_CODE", ["another tpkit"])
    changed.append(plan_cache.key(**args))
    assert len(set(changed)) == len(changed) and base not in changed
    renamed = load_config(source, path)
    renamed.name_or_path = "/elsewhere/llama"  # the same model in another directory
    monkeypatch.setattr(plan_cache, "_CODE", [])
    assert plan_cache.key(**dict(args, config=renamed)) == base


def test_unreadable_and_stale_entries(llama, cache, traced):
    path, ref = llama
    tpkit.launch(_load, 2, backend="threads", args=(path, ref))
    (stored,) = cache.iterdir()
    stored.write_text("{not json")  # unreadable: decided anew, and stored again
    for err, _ in tpkit.launch(_load, 2, backend="threads", args=(path, ref)):
        assert err < 1e-5
    assert len(traced) == 4 and json.loads(stored.read_text())["world_size"] == 2
    plan = json.loads(stored.read_text())
    plan["entries"]["model.layers.0.no_such_module"] = "colwise"  # stale: names a module the model lacks
    stored.write_text(json.dumps(plan))
    with pytest.raises(Exception) as caught:
        tpkit.launch(_load, 2, backend="threads", args=(path, ref))
    assert "plan cache" in "".join(getattr(caught.value, "__notes__", [])) + str(caught.value), caught.value
    assert not stored.exists()  # deleted: the next load decides anew
    for err, _ in tpkit.launch(_load, 2, backend="threads", args=(path, ref)):
        assert err < 1e-5


@pytest.fixture(scope="module")
def bigbird(tmp_path_factory):
    """A BigBird causal LM directory, inputs, and transformers' logits. BigBird swaps its block-sparse attention for
    full attention on short inputs, in its forward (the trace's)."""
    import transformers

    config = transformers.BigBirdConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=37, max_position_embeddings=64, is_decoder=True)
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("bigbird") / "hf")
    transformers.BigBirdForCausalLM(config).save_pretrained(path)
    ids = torch.randint(0, 99, (2, 8))
    with torch.no_grad():
        ref = transformers.BigBirdForCausalLM.from_pretrained(path)(input_ids=ids).logits
    return path, ids, ref


def _bigbird_twice(path, ids):
    out = []
    for _ in range(2):
        model = tpkit.from_pretrained(path, progress=False)
        with torch.no_grad():
            out.append(model(input_ids=ids).logits)
    return out


def test_a_model_that_rewrites_itself_in_its_forward_is_not_stored(cache, bigbird):
    """A plan applied without BigBird's forward would meet the other attention. Nothing is stored; both loads equal
    transformers'."""
    path, ids, ref = bigbird
    for logits in tpkit.launch(_bigbird_twice, 2, backend="threads", args=(path, ids)):
        assert all(rel(x, ref) < 1e-5 for x in logits)
    assert not cache.exists() or not os.listdir(cache)


def _saved_and_reloaded(path, out, ids):
    model = tpkit.from_pretrained(path, progress=False)
    tpkit.save_sharded(model, out, progress=False)
    again = tpkit.from_pretrained(out, progress=False)
    with torch.no_grad():
        return again(input_ids=ids).logits, model.tp_plan.replaced_by_forward


def test_a_tpkit_checkpoint_of_a_model_that_rewrites_itself_is_traced_again_on_reload(bigbird, tmp_path, traced):
    """Its plan records the modules its forward replaced, and the reload at the saved world size runs that forward
    (a trace) before applying it, instead of applying it as recorded to the attention from before."""
    path, ids, ref = bigbird
    out = str(tmp_path / "tp")
    for logits, replaced in tpkit.launch(_saved_and_reloaded, 2, backend="threads", args=(path, out, ids)):
        assert rel(logits, ref) < 1e-5
        assert sorted(replaced) == [f"bert.encoder.layer.{i}.attention.self" for i in (0, 1)]
    (manifest,) = glob.glob(os.path.join(out, "*", "manifest.json"))
    with open(manifest) as f:
        assert json.load(f)["plan"]["replaced_by_forward"] == list(replaced)
    assert len(traced) == 4  # each rank: the first load's trace and the reload's


def test_ranks_use_a_stored_plan_only_when_all_found_it():
    from tpkit.convert.plan import Plan

    plan = Plan({"a": "colwise"}, world_size=2)

    def body(comm, digests):
        return plan_cache.agreed(comm, (plan, digests[comm.rank]) if digests[comm.rank] is not None else None)

    assert tpkit.launch(body, 2, backend="threads", args=((7, 7),), pass_comm=True) == [plan, plan]
    assert tpkit.launch(body, 2, backend="threads", args=((None, 7),), pass_comm=True) == [None, None]
    assert tpkit.launch(body, 2, backend="threads", args=((7, 8),), pass_comm=True) == [None, None]  # other bytes


def test_a_class_without_a_source_file_is_never_cached(llama, cache):
    import types

    from tpkit.checkpoint.load import open_source
    from tpkit.checkpoint.pretrained import build, load_config

    path, _ = llama
    source = open_source(path, 0, 1)
    config = load_config(source, path)
    model = build(config, None, torch.float32)
    args = (config, source, torch.float32, {}, 2, "inference", None)
    assert plan_cache.key(model, *args) is not None
    notebook = types.ModuleType("notebook_cell")  # what a class defined in a notebook or `python -c` has
    cls = type("CellNorm", (torch.nn.Module,), {"__module__": "notebook_cell", "forward": lambda self, x: x})
    import sys

    sys.modules["notebook_cell"] = notebook
    try:
        model.model.extra = cls()
        assert plan_cache.key(model, *args) is None
    finally:
        del sys.modules["notebook_cell"]


def test_off_by_the_switch(llama, cache, monkeypatch):
    path, ref = llama
    monkeypatch.setenv("TPKIT_PLAN_CACHE", "0")
    for err, _ in tpkit.launch(_load, 2, backend="threads", args=(path, ref)):
        assert err < 1e-5
    assert not cache.exists()
