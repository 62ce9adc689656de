"""bf16 and fp16 checkpoints load at any `dtype=`, through every entry path, as transformers loads them.

Three directories written by `save_pretrained`: a Llama with tied embeddings in bf16, a Qwen2 (tied embeddings, q/k/v
biases) in fp16, a float32 Llama. Each is loaded at its default dtype (None / "auto": the config's, as transformers 5
resolves it), at float32 and at the other half dtype (float64 for the float32 one), through
- `from_pretrained(path, dtype=...)`;
- a model the user builds on the meta device in that dtype, converted, then `load_sharded` of the Hugging Face
  directory, and of a tpkit checkpoint saved at the stored dtype (a bf16 tpkit checkpoint into a float32 model);
- `Checkpointer.resume` of a run saved in bf16 into a float32 model and AdamW (torch's `Optimizer.load_state_dict`
  policy: floating state takes the parameter's dtype, `step` keeps its own), which then trains on;
- `consolidate`, which keeps the dtype the checkpoint was saved in (and says so in config.json).
Every state-dict tensor has transformers' dtype and equals the slice of transformers' tensor bit for bit (the same
cast of the same stored values); `config.dtype` is what transformers records; the logits are within float32 rel 1e-5
(float64: 1e-10) of transformers' load of the same directory in the same dtype. In bf16 / fp16 the bound is 3x the
reference's own half-precision error (its logits against its float64 load of the same directory): the TP spread
measured on these models at 2 and 3 ranks is 1.0-1.4x that error (bf16: 7.2e-3-1.3e-2 against 6.5e-3-1.2e-2; fp16:
7.5e-4-1.6e-3 against 6.7e-4-1.3e-3; `python bench/dtypes.py`, BENCHMARKS.md). Thread-ranks at 2 and 3; gloo processes at 3, one launch for `from_pretrained` in each dtype and
the Checkpointer (what differs between processes: collectives in each dtype, forward and backward)."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import tpkit
from tests.checkpoint.fixtures import rel
from tests.models.hf import hf_model, inputs

DIRS = {  # name -> (family, stored dtype, dtypes to load at besides the default)
    "llama-bf16": ("llama", torch.bfloat16, (torch.float32, torch.float16)),
    "qwen2-fp16": ("qwen2", torch.float16, (torch.float32, torch.bfloat16)),
    "llama-f32": ("llama", torch.float32, (torch.float64,)),
}
DEFAULT = {"llama-bf16": None, "qwen2-fp16": "auto", "llama-f32": None}  # both spellings of transformers' default
CASES = [(name, d) for name, (_, _, others) in DIRS.items() for d in (DEFAULT[name], *others)]


def _key(name: str, dtype) -> str:
    return f"{name}@{dtype if isinstance(dtype, str) or dtype is None else str(dtype).removeprefix('torch.')}"


def _bound(dtype: torch.dtype, logits: torch.Tensor, exact: torch.Tensor) -> float:
    return {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype) or 3 * rel(logits, exact)


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """The directories, and per case transformers' load: config dtype, state dict, buffer dtypes, logits, bound."""
    import transformers as tr

    root = tmp_path_factory.mktemp("dtypes")
    paths = {}
    for name, (family, stored, _) in DIRS.items():
        paths[name] = str(root / name)
        model = hf_model(family, tie_word_embeddings=True, num_key_value_heads=2, initializer_range=0.1)
        model.to(stored).save_pretrained(paths[name])
    exact, out = {}, {}
    for name, dtype in CASES:
        ref = tr.AutoModelForCausalLM.from_pretrained(paths[name], **({} if dtype is None else {"dtype": dtype}))
        with torch.no_grad():
            logits = ref(input_ids=inputs()).logits
            if name not in exact and ref.dtype in (torch.bfloat16, torch.float16):
                exact[name] = tr.AutoModelForCausalLM.from_pretrained(paths[name], dtype=torch.float64)(
                    input_ids=inputs()).logits
        out[_key(name, dtype)] = {"config": ref.config.dtype, "state": ref.state_dict(), "logits": logits,
                                  "buffers": {n: b.dtype for n, b in ref.named_buffers()},
                                  "bound": _bound(ref.config.dtype, logits, exact.get(name))}
    return paths, out


def _meta_model(path: str, dtype: torch.dtype):
    """The model a user builds on the meta device in `dtype` (buffers on meta too: load_sharded computes them)."""
    import transformers as tr

    from tpkit.convert.transformers_threads import building

    config = tr.AutoConfig.from_pretrained(path)
    with building(), torch.device("meta"):  # one transformers build at a time in a process of thread-ranks
        return tr.AutoModelForCausalLM.from_config(config, dtype=dtype)


def _problems(model, ref: dict, where: str) -> list[str]:
    """Where `model` (this rank's) differs from transformers' load `ref`: config dtype, each state-dict tensor's
    dtype and value (its slice), buffer dtypes, logits."""
    bad = []
    if model.config.dtype != ref["config"]:
        bad.append(f"{where}: config.dtype {model.config.dtype}, transformers records {ref['config']}")
    layouts = tpkit.shard_layouts(model)
    for k, t in model.state_dict().items():
        want = ref["state"][k]
        if t.dtype != want.dtype:
            bad.append(f"{where}: {k} is {t.dtype}, transformers' is {want.dtype}")
        elif not torch.equal(t, layouts[k].shard(want)):
            bad.append(f"{where}: {k} differs from transformers' slice by {(t - layouts[k].shard(want)).abs().max()}")
    buffers = {n: b.dtype for n, b in model.named_buffers()}
    if buffers != ref["buffers"]:
        bad.append(f"{where}: buffer dtypes {buffers}, transformers' {ref['buffers']}")
    with torch.no_grad():
        logits = model(input_ids=inputs()).logits
    err = rel(logits, ref["logits"])
    if logits.dtype != ref["logits"].dtype or not err <= ref["bound"]:
        bad.append(f"{where}: logits {logits.dtype} rel {err:.2e} (bound {ref['bound']:.1e}, transformers' are "
                   f"{ref['logits'].dtype})")
    return bad


def _checkpointer(path: str, directory: str, comm) -> list[str]:
    """A run of the bf16 checkpoint saved after one AdamW step, resumed into a float32 model and AdamW: parameters
    and moments are the saved ones cast to float32 (torch's policy), `step` as saved; one more step trains."""
    ids = inputs()
    half = tpkit.from_pretrained(path, comm=comm, mode="training", progress=False)
    opt = torch.optim.AdamW(half.parameters(), lr=1e-3)
    half(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    tpkit.Checkpointer(directory, every=1, comm=comm, check_replicas_every=None).save(1, half, opt)
    full = tpkit.from_pretrained(path, comm=comm, mode="training", dtype=torch.float32, progress=False)
    opt32 = torch.optim.AdamW(full.parameters(), lr=1e-3)
    start = tpkit.Checkpointer(directory, every=1, comm=comm, check_replicas_every=None).resume(full, opt32)
    bad = [] if start == 1 else [f"checkpointer: resumed at step {start}, saved at 1"]
    saved = dict(half.named_parameters())
    for name, p in full.named_parameters():
        h = saved[name]
        if p.dtype != torch.float32 or not torch.equal(p, h.float()):
            bad.append(f"checkpointer: {name} is {p.dtype}, not the saved {h.dtype} values in float32")
        for s, v in opt32.state[p].items():
            want = opt.state[h][s]
            cast = want if s == "step" else want.float()
            if v.dtype != cast.dtype or not torch.equal(v, cast):
                bad.append(f"checkpointer: {name} {s} is {v.dtype}, torch's load_state_dict gives {cast.dtype}")
    full(input_ids=ids, labels=ids).loss.backward()
    opt32.step()
    if {p.dtype for p in full.parameters()} != {torch.float32}:
        bad.append("checkpointer: a step after the resume left parameters not float32")
    return bad


def entry_paths_body(paths: dict, refs: dict, root: str, checks: tuple[str, ...], metas: dict | None = None
                     ) -> dict[str, list[str]]:
    """The cases in `refs` through the entry paths named in `checks` on this rank (module level: gloo processes
    import it). `metas`: the meta-built models by case (thread-ranks deep-copy them; processes build their own).
    Saves under `root`."""
    comm = tpkit.get_communicator()
    out = {check: [] for check in checks}
    for name, (_, stored, others) in DIRS.items():
        tp_ckpt = os.path.join(root, name)
        for i, dtype in enumerate((DEFAULT[name], *others)):
            key = _key(name, dtype)
            if key not in refs:
                continue
            ref = refs[key]
            model = tpkit.from_pretrained(paths[name], comm=comm, dtype=dtype, progress=False)
            out["from_pretrained"] += _problems(model, ref, f"from_pretrained {key}")
            if "load_sharded" not in checks:
                continue
            if i == 0:  # the checkpoint's own dtype: saved as a tpkit checkpoint for the loads below
                tpkit.save_sharded(model, tp_ckpt, comm=comm)
                continue
            if name == "llama-bf16" and dtype == torch.float32:  # consolidated by the test: the dtype it was saved in
                tpkit.save_sharded(model, os.path.join(root, "bf16-as-float32"), comm=comm)
            plan = model.tp_plan  # a user's conversion of the same model (no second trace)
            for source in ((paths[name], tp_ckpt) if i == 1 else (tp_ckpt,)):
                meta = copy.deepcopy(metas[key]) if metas is not None else _meta_model(paths[name], dtype)
                model = tpkit.parallelize(meta, plan, comm=comm)
                tpkit.load_sharded(model, source, comm=comm, progress=False)
                where = f"load_sharded {'HF' if source == paths[name] else 'tpkit'} {name} into {dtype}"
                out["load_sharded"] += _problems(model, ref, where)
    if "checkpointer" in checks:
        out["checkpointer"] = _checkpointer(paths["llama-bf16"], os.path.join(root, "run"), comm)
    return out


@pytest.fixture(scope="module")
def runs(refs, tmp_path_factory):
    """`entry_paths_body` per (backend, world), run once each when first asked for: rank -> path -> problems."""
    paths, want = refs
    metas = {_key(n, d): _meta_model(paths[n], d) for n, (_, _, others) in DIRS.items() for d in others}
    done: dict = {}

    def get(backend: str, world: int):
        if (backend, world) not in done:
            root = str(tmp_path_factory.mktemp(f"{backend}{world}"))
            # gloo runs what differs between processes: collectives in each dtype, forward and backward
            checks = ("from_pretrained", "checkpointer") + (("load_sharded",) if backend == "threads" else ())
            cases = want if backend == "threads" else {k: want[k] for k in GLOO_CASES}
            args = (paths, cases, root, checks) + ((metas,) if backend == "threads" else ())
            done[backend, world] = (tpkit.launch(entry_paths_body, world, backend=backend, args=args, timeout=300),
                                    root)
        return done[backend, world]

    return get


# the case (a bf16 checkpoint asked for float32), and a forward in each other dtype
GLOO_CASES = ("llama-bf16@None", "llama-bf16@float32", "qwen2-fp16@auto", "llama-f32@float64")
RUNS = [("threads", 2), ("threads", 3), pytest.param("gloo", 3, marks=pytest.mark.slow)]


def _report(results: list, path: str) -> list[str]:
    return [f"rank {r}: {p}" for r, res in enumerate(results) for p in res[path]]


@pytest.mark.parametrize("backend, world", RUNS)
def test_from_pretrained_loads_each_dtype_as_transformers(runs, backend, world):
    bad = _report(runs(backend, world)[0], "from_pretrained")
    assert not bad, "\n".join(bad[:10])


@pytest.mark.parametrize("backend, world", RUNS[:2])
def test_load_sharded_casts_into_the_models_dtype(runs, backend, world):
    """A Hugging Face directory and a tpkit checkpoint in the stored dtype, into a meta-built model of another."""
    bad = _report(runs(backend, world)[0], "load_sharded")
    assert not bad, "\n".join(bad[:10])


@pytest.mark.parametrize("backend, world", RUNS)
def test_checkpointer_resumes_a_bf16_run_in_float32(runs, backend, world):
    bad = _report(runs(backend, world)[0], "checkpointer")
    assert not bad, "\n".join(bad[:10])


@pytest.mark.parametrize("saved, case", [("llama-bf16", ("llama-bf16", None)),
                                         ("qwen2-fp16", ("qwen2-fp16", "auto")),
                                         ("bf16-as-float32", ("llama-bf16", torch.float32))])
def test_consolidate_keeps_the_saved_dtype(refs, runs, saved, case, tmp_path):
    """What a run saved in bf16 / fp16 / float32 consolidates to: tensors and config.json in that dtype, which
    transformers' default load then takes, giving the logits of the model that was saved."""
    import transformers as tr
    from safetensors import safe_open

    _, want = refs
    ref = want[_key(*case)]
    out = tpkit.consolidate(os.path.join(runs("threads", 3)[1], saved), tmp_path / "hf")
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        stored = {f.get_slice(k).get_dtype() for k in f.keys()}
    name = str(ref["config"]).removeprefix("torch.")
    assert stored == {{"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[name]}, stored
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == name
    back = tr.AutoModelForCausalLM.from_pretrained(out)
    assert back.dtype == ref["config"]
    with torch.no_grad():
        assert rel(back(input_ids=inputs()).logits, ref["logits"]) <= ref["bound"]


def test_a_dtype_that_is_not_a_compute_dtype_is_refused(refs):
    paths, _ = refs
    for bad in ("int8", torch.int64, "float8_e4m3fn", "bogus"):
        with pytest.raises(ValueError, match=rf"dtype={bad!r}.*floating torch dtype or its name.*'auto'"):
            tpkit.launch(lambda: tpkit.from_pretrained(paths["llama-bf16"], dtype=bad, progress=False), 1,
                         backend="threads")


def test_no_dtype_follows_the_installed_transformers(refs, monkeypatch):
    """transformers 5 reads dtype=None as "auto" (the cases above: None gives transformers' own load); 4.x loaded in
    torch's default dtype, float32, and "auto" in the checkpoint's."""
    from tpkit.checkpoint import pretrained

    paths, _ = refs
    assert pretrained.none_means_auto()
    monkeypatch.setattr(pretrained, "none_means_auto", lambda: False)
    dtypes = [tpkit.launch(lambda: tpkit.from_pretrained(paths["llama-bf16"], dtype=d, progress=False).dtype, 1,
                           backend="threads")[0] for d in (None, "auto")]
    assert dtypes == [torch.float32, torch.bfloat16]


def test_load_sharded_never_casts_fp8_or_integers(tmp_path):
    """Floating tensors cast into the model's dtype; FP8 values (meaningless without their scales) and integers
    do not, and the model is left as it was."""
    from safetensors.torch import save_file

    model = torch.nn.Linear(4, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    save_file({"weight": torch.randn(3, 4).to(torch.float8_e4m3fn), "bias": torch.randn(3)}, str(tmp_path / "a.st"))
    with pytest.raises(tpkit.CheckpointError, match=r"tensor 'weight' is torch.float8_e4m3fn, the model's weight is "
                                                    r"torch.float32"):
        tpkit.launch(lambda: tpkit.load_sharded(model, str(tmp_path / "a.st"), progress=False), 1, backend="threads")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    half = {"weight": torch.randn(3, 4).to(torch.bfloat16), "bias": torch.randn(3).to(torch.float16)}
    save_file(half, str(tmp_path / "b.st"))
    tpkit.launch(lambda: tpkit.load_sharded(model, str(tmp_path / "b.st"), progress=False), 1, backend="threads")
    assert model.weight.dtype == torch.float32 and torch.equal(model.weight, half["weight"].float())
    assert torch.equal(model.bias, half["bias"].float())


def test_tensors_transformers_keeps_in_float32_stay_float32(tmp_path):
    """GPT-OSS keeps its norms in float32 at float16 (`_keep_in_fp32_modules`, applied by transformers' load): a
    bf16 checkpoint of it asked for float16 loads with transformers' dtype for every tensor."""
    import transformers as tr

    from tpkit.comm import run_threads

    cfg = tr.GptOssConfig(vocab_size=101, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=64, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    path = str(tmp_path / "gpt-oss")
    tr.GptOssForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    ref = tr.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
    # grouped_mm has no float64 kernel on the CPU: the reference in float64 runs the experts' eager loop
    exact = tr.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
    with torch.no_grad():
        logits = ref(input_ids=inputs()).logits
        bound = _bound(torch.float16, logits, exact(input_ids=inputs()).logits)
    want = {"config": ref.config.dtype, "state": ref.state_dict(), "logits": logits, "bound": bound,
            "buffers": {n: b.dtype for n, b in ref.named_buffers()}}
    kept = {k for k, v in want["state"].items() if v.dtype == torch.float32}
    assert kept and all(k.endswith("norm.weight") for k in kept), kept

    def body(comm):
        with tpkit.convert.quiet_conversions():
            m = tpkit.from_pretrained(path, comm=comm, dtype=torch.float16, progress=False)
        return _problems(m, want, f"rank {comm.rank}")

    bad = [p for r in run_threads(body, 2) for p in r]
    assert not bad, "\n".join(bad[:10])
