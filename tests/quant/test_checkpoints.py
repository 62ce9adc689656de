"""Quantized checkpoints load per rank and equal transformers' single-process load of the same directory.

Every format (`checkpoints.py` makes them the ecosystem's way) at 2 and 3 ranks on thread-ranks: the logits equal
the reference's within float32 rounding, every rank's dequantized weight equals the slice of the reference's
dense weight bit for bit (`QuantMethod.dense` is the dense layout the stored slices follow), and each rank holds
at most 1.15 x the stored bytes of the part of each weight it holds (its dense share: whole heads, KV heads held by
two ranks and whole groups make shares uneven; the stored tensors add at most 15% to that). Llama's MLP has 640 = 5 groups of 128
features (3 / 2 at 2 ranks, 2 / 2 / 1 at 3), its o_proj 256 = 2 groups over 3 ranks of whole heads (a group two
ranks share), k/v 2 KV heads over 3 ranks (rows two ranks hold).
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

import tpkit
from tpkit.comm import run_threads
from tpkit.nn.quantized import quant_method_of
from tpkit.quant import QuantizationError, fused, native
from tests.quant import checkpoints as C

pytest.importorskip("compressed_tensors")

IDS, INT4, FORMATS = C.IDS, C.INT4, C.FORMATS


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Each format's directory, its reference model and logits, made once."""
    root = tmp_path_factory.mktemp("quantized")
    bases = {"llama": C.llama(), "qwen2": C.qwen2(), "phi3": C.phi3()}
    dirs: dict[str, tuple[str, str | None]] = {}

    def directory(name: str) -> str:
        if name not in dirs:
            model, maker = FORMATS[name]
            dirs[name] = maker(str(root / name), bases[model], directory)
        return dirs[name][0]

    refs: dict[str, tuple] = {}

    def get(name: str):
        if name not in refs:
            d = directory(name)
            ref = C.reference(d, dirs[name][1])
            with torch.no_grad():
                refs[name] = (d, ref, ref(IDS).logits)
        return refs[name]

    return get


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


#: formats whose layers compute with a fast product where their slice maps onto one (`tpkit.quant.products`): tpkit's
#: compiled product (where a C compiler built it) and torch's weight-only kernels (`tpkit.quant.kernels`); the
#: candidates each layer measured, any of which it may keep
FAST = {"ct-int4-group-asym": {"int4", "native uint4"}, "ct-int4-group-sym": {"int4", "native uint4"},
        "ct-int8-channel-pack": {"int8", "native uint8"}, "ct-w8a16-int": {"int8", "native int8"}}
if native.available():
    FAST.update({"ct-fp8-block": {"native fp8"}, "ct-fp8-channel": {"native fp8"}, "ct-fp8-naive": {"native fp8"},
                 "hf-fp8-block": {"native fp8"}})


def _check(directory: str, ref, want: torch.Tensor, world: int, fast: set | None = None) -> list[str]:
    dense = {k: v for k, v in ref.state_dict().items()}

    def body(comm):
        model = tpkit.from_pretrained(directory, comm=comm, progress=False)
        with torch.no_grad():
            got = model(IDS).logits
        bad, packed, local, quantized, kernels = [], 0, 0, 0, set()
        for name, m in model.named_modules():
            st = quant_method_of(m)
            if st is None:
                continue
            quantized += 1
            kernels.add(st.kernel)
            want_w = st.dense.shard(dense[f"{name}.weight"])
            if not torch.equal(m.weight, want_w):
                bad.append(f"rank {comm.rank} {name}: dequantized weight differs from the reference's slice by "
                           f"{(m.weight - want_w).abs().max():.3g}")
            share = st.dense.local_numel / torch.Size(st.dense.full_shape).numel()  # the rank's part of the weight
            for s in st.specs:
                t = m._buffers[s]
                local += t.numel() * t.element_size()
                packed += torch.Size(st.specs[s].shape).numel() * t.element_size() * share
        if quantized == 0:
            bad.append("no layer was loaded quantized")
        if fast is not None and not kernels & fast:
            bad.append(f"rank {comm.rank}: no layer computes with a fast product ({fast}; they use {kernels})")
        if local > 1.15 * packed + 16 * quantized:  # + weight_shape, the one tensor every rank holds whole
            bad.append(f"rank {comm.rank} holds {local} bytes of quantized tensors, over 1.15 x its share of the "
                       f"weights' stored bytes ({packed:.0f})")
        err = _rel(got, want)
        if not err < 1e-5:
            bad.append(f"rank {comm.rank}: logits rel {err:.2e}")
        for way in fused.CANDIDATES:  # a GPU's decode products (uncompiled: the test's `_compiled`), one row each
            comm.barrier()
            fused.set_policy(way)
            comm.barrier()
            with torch.no_grad():
                err = _rel(model(IDS[:, :1]).logits, want[:, :1])
            if not err < 1e-5:
                bad.append(f"rank {comm.rank}: the fused {way} product's logits rel {err:.2e}")
        return bad

    return [b for r in run_threads(body, world) for b in r]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_rank_reads_its_packed_slice_and_equals_transformers(made, fmt, world, monkeypatch):
    directory, ref, want = made(fmt)
    fused_calls = []
    monkeypatch.setattr(fused, "POLICY", "0")  # restored after; `_check` forces each fused candidate in turn
    monkeypatch.setattr(fused, "_CHOSEN", {})  # the choices and functions made with the uncompiled candidates
    monkeypatch.setattr(fused, "_COMPILED", {})  # stay here
    monkeypatch.setattr(fused, "_compiled", lambda fn: lambda *a: fused_calls.append(fn.__name__) or fn(*a))
    bad = _check(directory, ref, want, world, FAST.get(fmt))
    assert not bad, f"{fmt} at {world} ranks:\n" + "\n".join(bad[:8])
    assert "generic_product" in fused_calls
    assert ("words_product" in fused_calls) is fmt.startswith(("ct-int4", "ct-int8-channel-pack")), fused_calls


def test_processes_greedy_generate_gives_transformers_tokens(made):
    directory, ref, _ = made("ct-int4-group-asym")
    with torch.no_grad():
        want = ref.generate(IDS[:1, :5], max_new_tokens=6, do_sample=False)
    got = tpkit.launch(_generate, 3, args=(directory, IDS[:1, :5]))  # and of both copies of it
    assert all(torch.equal(g, want) for rank in got for g in rank), (got, want)


def _generate(directory: str, ids: torch.Tensor) -> list[torch.Tensor]:
    """The tokens of the loaded model, of its deep copy and of its `torch.save` / `torch.load` copy (each gloo rank
    rebinds its communicator)."""
    from tests.nn.helpers import copied

    model = tpkit.from_pretrained(directory, progress=False)
    with torch.no_grad():
        return [m.generate(ids, max_new_tokens=6, do_sample=False)
                for m in (model, copied(model, "deepcopy"), copied(model, "torch.save"))]


def test_save_at_two_ranks_reload_at_three_and_consolidate_in_the_original_format(made, tmp_path):
    import transformers as tr

    directory, ref, want = made("ct-int4-group-asym")
    ck, out = str(tmp_path / "ck"), str(tmp_path / "hf")
    run_threads(lambda comm: tpkit.save_sharded(tpkit.from_pretrained(directory, comm=comm, progress=False), ck,
                                                comm=comm), 2)
    keys = set()

    def reload(comm):
        model = tpkit.from_pretrained(ck, comm=comm, progress=False)
        keys.update(model.state_dict())
        with torch.no_grad():
            return _rel(model(IDS).logits, want)

    assert max(run_threads(reload, 3)) < 1e-5
    assert "model.layers.0.mlp.down_proj.weight_packed" in keys and "model.layers.0.mlp.down_proj.weight" not in keys
    tpkit.consolidate(ck, out)
    back = tr.AutoModelForCausalLM.from_pretrained(out, quantization_config=tr.CompressedTensorsConfig(dequantize=True))
    with torch.no_grad():
        assert torch.equal(back.eval()(IDS).logits, want)


@pytest.mark.parametrize("fmt", ["ct-int4-group-asym", "gptq-desc-act"])
def test_gradients_reach_the_input_through_packed_layers(made, fmt):
    """A frozen quantized base under an adapter: the input's gradient equals the reference's (the kernels have
    no backward, so an input that needs one goes through the dequantized slice)."""
    directory, ref, _ = made(fmt)
    embeds = ref.get_input_embeddings()(IDS).detach()
    e = embeds.clone().requires_grad_(True)
    ref(inputs_embeds=e).logits.square().sum().backward()

    def body(comm):
        model = tpkit.from_pretrained(directory, comm=comm, progress=False)
        x = embeds.clone().requires_grad_(True)
        model(inputs_embeds=x).logits.square().sum().backward()
        return _rel(x.grad, e.grad)

    assert max(run_threads(body, 3)) < 1e-5


def test_dequantize_loads_dense_trainable_weights(made):
    directory, ref, want = made("gptq-desc-act")
    dense = ref.state_dict()

    def body(comm):
        model = tpkit.from_pretrained(directory, comm=comm, progress=False, dequantize=True)
        lays = tpkit.shard_layouts(model)
        w = model.model.layers[0].self_attn.k_proj.weight
        assert w.requires_grad and quant_method_of(model.model.layers[0].self_attn.k_proj) is None
        assert torch.equal(w, lays["model.layers.0.self_attn.k_proj.weight"].shard(
            dense["model.layers.0.self_attn.k_proj.weight"]))
        with torch.no_grad():
            return _rel(model(IDS).logits, want)

    assert max(run_threads(body, 3)) < 1e-5


def test_bad_input_is_refused_before_any_weight_is_read(made, tmp_path):
    import transformers as tr

    directory, _, _ = made("ct-int8-channel-pack")
    bnb = C.copy_with_config(directory, str(tmp_path / "bnb"), lambda qc: (qc.clear(), qc.update(
        quant_method="bitsandbytes", load_in_4bit=True)))
    with pytest.raises(QuantizationError, match=r"quant_method 'bitsandbytes' is not supported; tpkit reads "
                                                r"compressed-tensors .*gptq.*awq"):
        tpkit.from_pretrained(bnb, progress=False)
    w8a8 = C.copy_with_config(directory, str(tmp_path / "w8a8"), lambda qc: qc["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}))
    with pytest.raises(QuantizationError, match="input_activations .*activation quantization"):
        tpkit.from_pretrained(w8a8, progress=False)
    loaded = tr.AutoModelForCausalLM.from_pretrained(directory)  # transformers' own compressed layers
    with pytest.raises(QuantizationError, match=r"model.layers.0.self_attn.q_proj \(\w+\) is already quantized "
                                                r"\(compressed-tensors\).*tpkit.from_pretrained"):
        run_threads(lambda comm: tpkit.parallelize(copy.deepcopy(loaded), comm=comm), 2)
    assert os.path.exists(directory)


@pytest.mark.parametrize("fmt", ["ct-int4-group-asym", "gptq", "hf-fp8-block"])
def test_analyze_and_estimate_count_the_bytes_the_checkpoint_stores(made, fmt):
    """On one device, the bytes of the file; per rank at 2 and 3 ranks, `analyze` gives the bytes the fullest rank
    holds after `from_pretrained` (its state dict: stored tensors, whole groups included; and what the quantized
    layers keep beside them: the maps where 3 ranks' heads cut a group), and `estimate_memory` the same (its formula
    lays each layer out as the load does: whole heads, whole groups in the MLP)."""
    import transformers as tr
    from safetensors import safe_open

    directory, _, _ = made(fmt)
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        stored = sum(f.get_slice(k).get_shape().__len__() and torch.Size(f.get_slice(k).get_shape()).numel()
                     * getattr(torch, {"F32": "float32", "I32": "int32", "I64": "int64", "F8_E4M3": "float8_e4m3fn",
                                       "BF16": "bfloat16", "F16": "float16", "I8": "int8"}[f.get_slice(k).get_dtype()]
                               ).itemsize for k in f.keys())
    config = tr.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = tr.AutoModelForCausalLM.from_config(config)
    report = tpkit.analyze(model, world_size=2, max_world_size=3)
    assert report.total_bytes == stored
    assert "quantized checkpoint" in report.recommendations[0] and "units of" in report.recommendations[0]
    assert tpkit.estimate_memory(config, 1, dtype=torch.float32).single.parameters == stored

    def held(comm):
        model = tpkit.from_pretrained(directory, comm=comm, progress=False)
        kept = [t for n, t in model.named_buffers() if n.rpartition(".")[2].startswith(("tp_qmap_", "tp_kernel_"))]
        return sum(t.numel() * t.element_size() for t in list(model.state_dict().values()) + kept)

    for world in (2, 3):
        fullest = max(run_threads(held, world))
        assert report.per_rank_bytes[world] == fullest, (world, report.per_rank_bytes[world], fullest)
        est = tpkit.estimate_memory(config, world, dtype=torch.float32).per_rank.parameters
        assert est == fullest, (world, est, fullest)
    assert report.per_rank_bytes[2] < 0.6 * stored


def test_a_setup_prediction_counts_the_stored_bytes(made):
    """`search`'s per-setup memory (`predict`) of a quantized config is the dense config's less what the rank does
    not hold: its dense block weights, plus the stored tensors (`estimate_memory`'s per-rank figures); and, as the
    traced rank splits the MLP in whole groups of 128 as the load does (384 of 640 features on rank 0, not 320),
    the larger share's activations at the step's peak: the prefill's 16 tokens x (gate, up, their product) x 64
    more features, float32."""
    import transformers as tr

    from tpkit.estimate.predict import Setup, predict

    config = tr.AutoConfig.from_pretrained(made("ct-int4-group-asym")[0])
    dense = copy.deepcopy(config)
    del dense.quantization_config
    got = predict(config, Setup(2), goal="decode", seq_len=16, dtype=torch.float32).memory_bytes
    want = predict(dense, Setup(2), goal="decode", seq_len=16, dtype=torch.float32).memory_bytes
    est_q = tpkit.estimate_memory(config, 2, dtype=torch.float32).per_rank.parameters
    est_d = tpkit.estimate_memory(dense, 2, dtype=torch.float32).per_rank.parameters
    assert est_q < 0.3 * est_d
    wider = 16 * 3 * (384 - 320) * 4
    assert abs(got - (want - est_d + est_q + wider)) <= 1e-6 * want, (got, want, est_d, est_q)


@pytest.mark.parametrize("world,sizes", [(2, (384, 256)), (3, (256, 256, 128))])
def test_groups_that_do_not_divide_split_whole(made, world, sizes):
    """640 MLP features in 5 groups of 128: the row layer's input and its column partners' output rows split on
    whole groups, unevenly, as heads are."""
    directory = made("ct-int4-group-asym")[0]

    def body(comm):
        model = tpkit.from_pretrained(directory, comm=comm, progress=False)
        mlp = model.model.layers[0].mlp
        return [quant_method_of(m).dense.sizes() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]

    for per_rank in run_threads(body, world):
        assert per_rank == [sizes] * 3


def test_quantized_layers_compile_without_graph_breaks(made):
    """`torch.compile(fullgraph=True)` traces the packed layers (the int4 kernel path and the dequantizing one)
    with no graph break; the eager backend keeps the test fast (inductor is exercised once elsewhere)."""
    directory, _, want = made("ct-int4-group-asym")

    def body(comm):
        model = tpkit.from_pretrained(directory, comm=comm, progress=False)
        with torch.no_grad():
            return _rel(torch.compile(model, fullgraph=True, backend="eager")(IDS).logits, want)

    assert max(run_threads(body, 2)) < 1e-5


def test_one_rank_builds_whole_quantized_layers_and_a_copy_computes_the_same(made):
    """World size 1: every quantized layer is built as tpkit's whole quantized layer (no `nn.Linear` swapped), with
    the checkpoint's keys; `deepcopy` and a `torch.save` / `torch.load` round trip of the model compute the same."""
    import io

    from tpkit.nn.quantized import QuantizedLinear

    directory, ref, want = made("ct-int4-group-asym")
    model = tpkit.from_pretrained(directory, progress=False)
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and type(layer).__name__ == "QuantizedLinear"
    assert quant_method_of(layer).kernel in FAST["ct-int4-group-asym"] and "weight" not in layer._parameters
    assert {"model.layers.0.mlp.down_proj.weight_packed", "model.layers.0.mlp.down_proj.weight_scale"} <= set(
        model.state_dict())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    with torch.no_grad():
        for m in (model, copy.deepcopy(model), torch.load(buffer, weights_only=False)):
            assert _rel(m(IDS).logits, want) < 1e-5


def test_a_quantized_load_attaches_the_record_once_and_checks_it_once(made, monkeypatch):
    """config -> plan -> build -> read slices -> check: the conversion record is attached once and the gradient
    sums checked once (before, the layers were built dense, swapped, and both happened again)."""
    import importlib

    steps = importlib.import_module("tpkit.convert.steps")
    converting = importlib.import_module("tpkit.convert.parallelize")  # (the package exports the function)
    calls = {"attach": 0, "check": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(steps, "attach", counted("attach", steps.attach))  # where the record step calls them
    monkeypatch.setattr(converting, "check_gradients", counted("check", converting.check_gradients))
    directory, _, want = made("ct-int4-group-asym")
    model = tpkit.from_pretrained(directory, progress=False)
    with torch.no_grad():
        assert _rel(model(IDS).logits, want) < 1e-5
    assert calls == {"attach": 1, "check": 1}


@pytest.mark.parametrize("fmt,world", [("ct-int4-group-asym", 2), ("gptq-desc-act", 3)])
def test_the_quantization_state_survives_deepcopy_and_torch_save(made, fmt, world):
    """A split quantized model after `copy.deepcopy` and after `torch.save` / `torch.load` of the module: each
    quantized layer has its own method (not the original's) with the same scheme, layouts, maps and kept product,
    applied through the rewrite protocol; the stored tensors and layouts are the original's; the logits equal
    transformers' load, the input's gradient equals the original's, and a `load_state_dict` into the copy picks its
    product anew (the load hook travels with it). int4 at 2 ranks keeps a fast product (resident tensors);
    act-order GPTQ at 3 has maps (`g_idx`) and KV rows two ranks hold."""
    from tests.nn.helpers import copied
    from tpkit.nn.rewrites import rewrites_of

    directory, _, want = made(fmt)
    embeds = torch.randn(1, IDS.shape[1], 256, generator=torch.Generator().manual_seed(2), dtype=torch.float32)

    def grad(model):
        x = embeds.clone().requires_grad_(True)
        model(inputs_embeds=x).logits.square().sum().backward()
        return x.grad

    def body(comm):
        model = tpkit.from_pretrained(directory, comm=comm, progress=False)
        methods = {n: quant_method_of(m) for n, m in model.named_modules() if quant_method_of(m) is not None}
        base_grad, bad = grad(model), []
        for how in ("deepcopy", "torch.save"):
            twin = copied(model, how)
            mods = dict(twin.named_modules())
            for name, old in methods.items():
                m = mods[name]
                new = quant_method_of(m)
                if new is None or new is old or rewrites_of(m).get("weight") is not new:
                    bad.append(f"{how} {name}: no method of its own through the rewrite protocol ({new})")
                    continue
                same = (new.scheme == old.scheme, new.layouts == old.layouts, new.dense == old.dense,
                        new.maps == old.maps, new.kernel == old.kernel,
                        [k for k, _ in new.resident] == [k for k, _ in old.resident])
                if not all(same):
                    bad.append(f"{how} {name}: state differs (scheme, layouts, dense, maps, kernel, resident): {same}")
            if tpkit.shard_layouts(twin) != tpkit.shard_layouts(model):
                bad.append(f"{how}: shard layouts differ")
            if not all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), model.state_dict().values())):
                bad.append(f"{how}: stored values differ")
            with torch.no_grad():
                err = _rel(twin(IDS).logits, want)
            gerr = _rel(grad(twin), base_grad)
            twin.load_state_dict(model.state_dict())
            with torch.no_grad():
                lerr = _rel(twin(IDS).logits, want)
            if not max(err, gerr, lerr) < 1e-5:
                bad.append(f"{how}: logits {err:.2e}, input gradient {gerr:.2e}, after load_state_dict {lerr:.2e}")
        return bad

    bad = [b for r in run_threads(body, world) for b in r]
    assert not bad, "\n".join(bad[:8])


def test_layers_a_plan_keeps_whole_are_built_whole_quantized(made):
    from tpkit.nn.quantized import QuantizedLinear

    directory, _, want = made("ct-int8-channel-pack")

    def body(comm):
        model = tpkit.from_pretrained(directory, comm=comm, progress=False, plan={"model.layers.0.mlp.*": "replicate"})
        mlp, lays = model.model.layers[0].mlp, tpkit.shard_layouts(model)
        assert all(isinstance(m, QuantizedLinear) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        assert lays["model.layers.0.mlp.down_proj.weight_packed"].is_replicated
        assert not isinstance(model.model.layers[1].mlp.down_proj, QuantizedLinear)
        with torch.no_grad():
            return _rel(model(IDS).logits, want)

    assert max(run_threads(body, 2)) < 1e-5


@pytest.mark.parametrize("fmt", sorted(FAST))
def test_every_fast_product_a_layer_may_keep_equals_its_dequantized_product(made, fmt):
    """Each candidate product of each layer (not only the one the measurement kept) computes `x W^T` of the layer's
    dequantized slice, at one and at several rows, at 2 and 3 ranks (slices that cut groups have none)."""
    directory = made(fmt)[0]
    x = torch.randn(3, 1, 1024, generator=torch.Generator().manual_seed(1))

    def body(comm):
        model = tpkit.from_pretrained(directory, comm=comm, progress=False)
        bad, seen = [], set()
        for name, m in model.named_modules():
            method = quant_method_of(m)
            if method is None:
                continue
            w = method.weight(m)
            stored = {n: m._buffers[n] for n in method.specs}
            for p in method.candidates:
                seen.add(p.name)
                resident = p.resident(stored)
                for rows in (x[0, :, :w.shape[1]], x[:, 0, :w.shape[1]]):
                    got, want = p(rows, resident), rows @ w.t()
                    err = float((got - want).abs().max() / want.abs().max())
                    if not err < 1e-5:
                        bad.append(f"rank {comm.rank} {name} {p.name} at {rows.shape[0]} rows: rel {err:.2e}")
        return bad, seen

    results = [r for world in (2, 3) for r in run_threads(body, world)]
    assert not [b for bad, _ in results for b in bad], [b for bad, _ in results for b in bad][:6]
    assert set().union(*(seen for _, seen in results)) == FAST[fmt]


@pytest.mark.parametrize("fmt", ["ct-int8-channel-pack", "ct-fp8-channel"])
def test_row_parallel_layers_with_per_channel_scales_compute_with_a_fast_product(made, fmt):
    """A row split's slice of a per-channel scale is the whole scale (one entry covers all its features): no map,
    so `o_proj` and `down_proj` reach a fast product as the column layers do (they used to dequantize per call)."""
    if fmt not in FAST:
        pytest.skip("no fast product for this format here")
    directory = made(fmt)[0]

    def body(comm):
        model = tpkit.from_pretrained(directory, comm=comm, progress=False)
        return {n: quant_method_of(m).kernel for n, m in model.named_modules() if quant_method_of(m) is not None}

    for kernels in run_threads(body, 2):
        assert all(k is not None for k in kernels.values()), kernels
