"""`from_pretrained` equals transformers' load followed by `parallelize` (gloo processes at world size 2, thread
ranks at 3); the tpkit checkpoints the gloo ranks save reload at other world sizes and consolidate back into a
directory transformers loads."""
from __future__ import annotations

import os

import pytest
import torch

import tpkit
from tests.checkpoint.fixtures import MODELS, hf_logits, logits_of, pretrained_and_save_body, rel, write_hf
from tests.models.hf import inputs


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    paths = {name: write_hf(str(root), name) for name in MODELS}
    return paths, {name: hf_logits(p) for name, p in paths.items()}


def _gloo_body(paths: dict, refs: dict, out: str, deep: str) -> tuple:
    """Both checks on gloo processes, one after the other in one start of them: `pretrained_and_save_body` and
    `_reuse_body(deep)`."""
    return pretrained_and_save_body(paths, refs, out), _reuse_body(deep)


@pytest.fixture(scope="module")
def gloo_runs(hf_dirs, deep_llama, tmp_path_factory):
    """One gloo launch at world size 2 (per rank: `_gloo_body`'s pair), and where it saved."""
    paths, refs = hf_dirs
    out = str(tmp_path_factory.mktemp("saved"))
    return tpkit.launch(_gloo_body, 2, backend="gloo", args=(paths, refs, out, deep_llama), timeout=240), out


@pytest.fixture(scope="module")
def gloo_saved(gloo_runs):
    """From that launch: from_pretrained of every model, then save_sharded of each (per rank, each model's error)."""
    results, out = gloo_runs
    return [first for first, _ in results], out


def test_index_and_shards_fixture_is_sharded(hf_dirs):
    assert os.path.exists(os.path.join(hf_dirs[0]["phi3"], "model.safetensors.index.json"))


def test_from_pretrained_on_gloo_world_2_equals_transformers(gloo_saved):
    results, _ = gloo_saved
    for rank, errs in enumerate(results):
        for name, err in errs.items():
            assert err < 1e-5, (rank, name, err)


def _threads_body(path, ref, full):
    model = tpkit.from_pretrained(path)
    layouts = tpkit.shard_layouts(model)
    differ = [k for k, v in model.state_dict().items() if not torch.equal(v, layouts[k].shard(full[k]))]
    inv = {n: b for n, b in model.named_buffers() if n.endswith("inv_freq")}
    return rel(logits_of(model), ref), differ, inv


@pytest.mark.parametrize("name", list(MODELS))
def test_from_pretrained_on_threads_world_3_equals_transformers_shards(hf_dirs, name):
    import transformers

    paths, refs = hf_dirs
    hf = transformers.AutoModelForCausalLM.from_pretrained(paths[name])
    full = hf.state_dict()
    hf_inv = {n: b for n, b in hf.named_buffers() if n.endswith("inv_freq")}
    for err, differ, inv in tpkit.launch(_threads_body, 3, backend="threads", args=(paths[name], refs[name], full)):
        assert err < 1e-5 and not differ, (err, differ)
        assert inv.keys() == hf_inv.keys() and all(torch.equal(inv[k], hf_inv[k]) for k in inv)


def _load_body(directory, family, over, ref):
    from tests.models.hf import hf_model

    model = tpkit.parallelize(hf_model(family, initializer_range=0.9, **over))
    meta = tpkit.load_sharded(model, directory)
    return rel(logits_of(model), ref), meta


@pytest.mark.parametrize("world", [1, 3])
def test_saved_at_2_loads_at_other_world_sizes(hf_dirs, gloo_saved, world):
    _, refs = hf_dirs
    _, out = gloo_saved
    for name, (family, over, _) in MODELS.items():
        for err, meta in tpkit.launch(_load_body, world, backend="threads",
                                      args=(os.path.join(out, name), family, over, refs[name])):
            assert err < 1e-5, (name, world, err)
            assert meta["step"] == 7 and meta["extra"] == {"name": name}


def test_from_pretrained_reads_a_tpkit_checkpoint(hf_dirs, gloo_saved):
    _, refs = hf_dirs
    _, out = gloo_saved
    for err in tpkit.launch(lambda: rel(logits_of(tpkit.from_pretrained(os.path.join(out, "phi3"))), refs["phi3"]),
                            2, backend="threads"):
        assert err < 1e-5


def test_reload_at_the_saved_world_size_applies_the_recorded_plan_without_tracing(hf_dirs, gloo_saved, monkeypatch):
    """Same world size and mode: the manifest's plan is applied as recorded (no trace); the model equals the
    traced conversion. At another world size the model is planned (and traced) again."""
    from tpkit.convert.trace import structure

    _, refs = hf_dirs
    _, out = gloo_saved
    path = os.path.join(out, "phi3")
    traced = []
    real = structure.trace
    monkeypatch.setattr(structure, "trace", lambda *a, **k: traced.append(1) or real(*a, **k))
    for err in tpkit.launch(lambda: rel(logits_of(tpkit.from_pretrained(path)), refs["phi3"]), 2, backend="threads"):
        assert err < 1e-5
    assert not traced
    for err in tpkit.launch(lambda: rel(logits_of(tpkit.from_pretrained(path)), refs["phi3"]), 3, backend="threads"):
        assert err < 1e-5
    assert traced


def _pretrained_error(path):
    try:
        tpkit.from_pretrained(path)
    except tpkit.CheckpointError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("world", [2, 3])
def test_from_pretrained_checks_each_piece_it_reads(gloo_saved, tmp_path, world):
    """A flipped byte in rank 1's file: at world size 2 rank 1 reads its pieces whole and hashes the bytes as
    read; at 3 two ranks read parts of them and hash the pieces from disk. Every rank raises, naming the file."""
    import shutil

    _, out = gloo_saved
    copy = tmp_path / "llama"
    shutil.copytree(os.path.join(out, "llama"), copy)
    f = copy / (copy / "latest").read_text().strip() / "rank-00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x40
    f.write_bytes(bytes(data))
    for message in tpkit.launch(_pretrained_error, world, backend="threads", args=(str(copy),)):
        assert message is not None and "sha256" in message and "rank-00001" in message, message


def test_consolidate_gives_a_directory_transformers_loads(hf_dirs, gloo_saved, tmp_path):
    _, refs = hf_dirs
    _, out = gloo_saved
    for name in MODELS:
        tpkit.consolidate(os.path.join(out, name), tmp_path / name)
        assert rel(hf_logits(str(tmp_path / name)), refs[name]) < 1e-5, name


def test_cli_consolidate(gloo_saved, tmp_path):
    from tpkit.cli import main

    _, out = gloo_saved
    assert main(["consolidate", os.path.join(out, "llama"), str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "config.json").exists() and (tmp_path / "o" / "model.safetensors").exists()


def test_nothing_written_is_pickle(gloo_saved):
    _, out = gloo_saved
    for dirpath, _, files in os.walk(out):
        for f in files:
            assert f.endswith((".safetensors", ".json")) or f == "latest", f
            with open(os.path.join(dirpath, f), "rb") as fh:
                assert not fh.read(2).startswith(b"\x80"), f  # a pickle starts with PROTO (0x80)


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    """A float64 Llama of 5 blocks (they repeat: plan reuse cuts the trace to 2)."""
    from tests.models.hf import hf_model

    path = str(tmp_path_factory.mktemp("deep") / "llama")
    hf_model("llama", num_hidden_layers=5, num_key_value_heads=2).double().save_pretrained(path)
    return path


def _reuse_body(path):
    """from_pretrained with plan reuse on and off: (plans equal, states equal, output rel, gradient rel)."""
    got = []
    for reuse in (True, False):
        model = tpkit.from_pretrained(path, dtype=torch.float64, reuse=reuse, progress=False)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        out = model(input_ids=inputs()).logits
        out.pow(2).mean().backward()
        got.append((model.tp_plan.to_dict(), state, out.detach(),
                    {n: p.grad.clone() for n, p in model.named_parameters()}))
    (p1, s1, o1, g1), (p2, s2, o2, g2) = got
    same_state = s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    rel64 = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731 - in float64, unlike `rel`
    return p1 == p2, same_state, rel64(o1, o2), max(rel64(g1[k], g2[k]) for k in g2)


@pytest.mark.parametrize("world, backend", [(2, "gloo"), (3, "threads")])
def test_from_pretrained_with_plan_reuse_equals_the_whole_trace(deep_llama, world, backend, monkeypatch, request):
    """On gloo processes `_reuse_body` runs in the module's one gloo launch (`gloo_runs`)."""
    import importlib

    par = importlib.import_module("tpkit.convert.planning.decide")  # where the trace step calls it
    traced, real = [], par.analyze_structure
    monkeypatch.setattr(par, "analyze_structure", lambda *a, **k: traced.append(1) or real(*a, **k))
    if backend == "gloo":
        results = [second for _, second in request.getfixturevalue("gloo_runs")[0]]
    else:
        results = tpkit.launch(_reuse_body, world, backend=backend, args=(deep_llama,), timeout=240)
    for same_plan, same_state, out_err, grad_err in results:
        assert same_plan and same_state and out_err < 1e-9 and grad_err < 1e-9, (same_plan, same_state, out_err,
                                                                                 grad_err)
    if backend == "threads":
        assert len(traced) == world  # the whole model is traced with reuse off only


def _deepseek_v3(path: str) -> None:
    """A tiny DeepSeek-V3 (latent attention, one dense block then one of experts), saved as safetensors; its router's
    `e_score_correction_bias` (a persistent buffer) is made non-zero so a load that misses it shows."""
    import transformers as tr

    cfg = tr.DeepseekV3Config(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                              q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                              max_position_embeddings=64)
    torch.manual_seed(0)
    model = tr.DeepseekV3ForCausalLM(cfg).double()
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)


def test_from_pretrained_traces_deepseek_v3_with_real_buffers_beside_meta_parameters(tmp_path):
    """from_pretrained builds parameters on meta and buffers real: the trace must run on such a model (the router's
    real `e_score_correction_bias` once met meta scores, the trace failed and nothing was split). Its plan is the
    plan of the same model built wholly on meta and of the real model; its logits are transformers' own load's."""
    import transformers as tr

    from tpkit.comm import run_threads

    path = str(tmp_path / "deepseek_v3")
    _deepseek_v3(path)
    # grouped_mm has no float64 kernel on the CPU: both sides run the experts' eager loop
    ref_model = tr.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
    want = logits_of(ref_model)
    with torch.device("meta"):
        meta = tr.AutoModelForCausalLM.from_config(ref_model.config)
    planned = {"meta": tpkit.plan(meta, 2).entries, "real": tpkit.plan(ref_model, 2).entries}
    assert planned["meta"] == planned["real"]
    assert planned["meta"]["model.layers.1.mlp.experts"] == "experts_tp"
    assert planned["meta"]["model.layers.0.mlp.down_proj"] == "rowwise"

    def body(comm):
        model = tpkit.from_pretrained(path, comm=comm, dtype=torch.float64, progress=False)
        model.set_experts_implementation("eager")
        buffers = {n: b.device.type for n, b in model.named_buffers()}
        return logits_of(model), model.tp_plan.entries, buffers

    tr.AutoConfig  # noqa: B018 - transformers' lazy module is not thread-safe: load it before the thread-ranks
    for rank, (got, entries, buffers) in enumerate(run_threads(body, 2)):
        assert entries == planned["meta"], (rank, {k: (v, planned["meta"].get(k)) for k, v in entries.items()
                                                   if v != planned["meta"].get(k)})
        assert set(buffers.values()) == {"cpu"}, buffers
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-9, f"rank {rank}: logits rel err {err:.2e}"


RACE_SCRIPT = '''
import sys
import tpkit
from tpkit.comm import run_threads

run_threads(lambda comm: tpkit.from_pretrained(sys.argv[1], comm=comm, progress=False), 2)
print("loaded")
'''


def test_thread_ranks_of_a_fresh_interpreter_resolve_transformers_names(tmp_path):
    """The first use of transformers' lazy names happens on the thread-ranks themselves: they used to fail with
    "module 'transformers' has no attribute 'AutoConfig'" (four fresh interpreters in four before the fix)."""
    import subprocess
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path / "llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(path)
    src = os.path.dirname(os.path.dirname(tpkit.__file__))  # this tpkit, in the fresh interpreter too
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    for _ in range(2):  # each a fresh interpreter: the names are resolved for the first time in each
        done = subprocess.run([sys.executable, "-c", RACE_SCRIPT, path], capture_output=True, text=True, env=env,
                              timeout=240)
        assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-3000:]


SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)


def _special_tokens_body(comm, path, model, ids, ref):
    loaded = tpkit.from_pretrained(path, comm=comm, dtype=torch.float64, progress=False)
    built = tpkit.parallelize(model, comm=comm)
    return loaded.tp_plan.entries, built.tp_plan.entries, rel(loaded(input_ids=ids).logits, ref)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_checkpoint_setting_special_tokens_splits_as_the_model_built_in_memory(tmp_path, family):
    """Published configs set pad / bos / eos (and training ones `use_cache=False`): the model's forward then reads
    token values (transformers' padding check, its packed-sequence check), which a model built on the meta device
    once could not trace; `from_pretrained` split nothing where `parallelize` split the same model in memory."""
    import copy

    from tests.models.hf import hf_model

    import transformers

    hf_model(family, **SPECIAL_TOKENS).double().save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    ids = inputs()
    ref = model(input_ids=ids).logits.detach()  # transformers' own load, one process
    for world in (2, 3):
        copies = [copy.deepcopy(model) for _ in range(world)]
        results = tpkit.launch(lambda comm: _special_tokens_body(comm, str(tmp_path), copies[comm.rank], ids, ref),
                               world, backend="threads", pass_comm=True)
        for loaded, built, err in results:
            assert loaded == built and any(s != "replicate" for s in loaded.values()), (world, loaded)
            assert err < 1e-9, (world, err)
