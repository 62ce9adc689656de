"""LoRA under tensor parallelism against ONE process of plain transformers + PEFT (issue 37).

Both orders, `peft.get_peft_model` on a converted model and `tpkit.parallelize` of a PEFT model, give the same
model; 10 AdamW steps on the adapter at 2 and 3 ranks equal stock PEFT's (float64, rel 1e-9) step by step, every
rank's adapter slice equal to the reference's sliced by `shard_layouts`, and the whole factors bit-identical on
every rank; `merge_and_unload` leaves each rank the slice of PEFT's merged weight, and unmerging gives PEFT's
unmerged weight (to 1e-13 in float64: a rank computes B @ A in another shape, which BLAS may round otherwise).
Models: Llama with 8 query / 2 KV heads (at 3 ranks a KV head is held by two ranks and expanded on one), Qwen2
with tied embeddings, qkv biases, rsLoRA and LoRA on the LM head, Phi-3 with its fused qkv_proj and gate_up_proj
(split piece by piece), GPT-2 with its fused Conv1D c_attn and lora_bias. Also: stock adapter files both ways and
several adapters; mode="training" on thread-ranks and gloo processes; no collective added to the forward; refusals
(DoRA, an embedding split along its features, PiSSA) before anything changes; a checkpoint resumed at another
world size; estimate_memory / analyze of a PEFT model; DDP over the adapter.
"""
from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F

import tpkit

peft = pytest.importorskip("peft")

VOCAB, STEPS, LR, TOL = 103, 10, 1e-2, 1e-9
# A merged weight is base + B @ A: a rank multiplies its slice of B or A, one process the whole, and BLAS blocks
# the two shapes differently (1e-16 apart on some x86 boxes). float64 leaves 1e-13 for that and nothing more.
MERGE_TOL = 1e-13
_LOCK = threading.Lock()  # thread-ranks share torch's global RNG: PEFT's draws are serialised and seeded
_DEC = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=64)


def _build(cfg_name: str, cls_name: str, **kw) -> torch.nn.Module:
    import transformers as tr

    config = getattr(tr, cfg_name)(**kw)
    config._attn_implementation = "sdpa"
    with _LOCK:
        torch.manual_seed(1234)
        model = getattr(tr, cls_name)(config)
    return model.double()


ARCHS = {
    "llama": (lambda: _build("LlamaConfig", "LlamaForCausalLM", **_DEC),
              dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])),
    "qwen2_tied": (lambda: _build("Qwen2Config", "Qwen2ForCausalLM", **_DEC, tie_word_embeddings=True),
                   dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "lm_head"],
                        use_rslora=True)),
    "phi3": (lambda: _build("Phi3Config", "Phi3ForCausalLM", **_DEC, pad_token_id=0, bos_token_id=1, eos_token_id=2),
             dict(target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])),
    "gpt2": (lambda: _build("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4,
                            n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                            eos_token_id=0),
             dict(target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True, lora_bias=True)),
}


def lora_config(arch: str, **over) -> "peft.LoraConfig":
    kw = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **ARCHS[arch][1])
    kw.update(over)
    return peft.LoraConfig(**kw)


def with_adapter(model, config, seed: int = 7):
    """`peft.get_peft_model` under a fixed seed (every rank draws what one process draws)."""
    with _LOCK:
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (2, 9), generator=g)


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    if isinstance(logits, tpkit.nn.SplitLogits):  # training mode: computed on this rank's vocabulary slice
        return tpkit.vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], vocab_size=VOCAB)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def adapter_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def train(model, steps: int = STEPS):
    """Losses and the adapter after each AdamW step."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, states = [], []
    for step in range(steps):
        loss = loss_of(model, batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        states.append(adapter_state(model))
    return losses, states


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request):
    name = request.param
    base = ARCHS[name][0]()
    ref = with_adapter(copy.deepcopy(base), lora_config(name))
    initial = adapter_state(ref)
    trainable = sorted(n for n, p in ref.named_parameters() if p.requires_grad)
    losses, states = train(ref)
    return name, base, dict(losses=losses, states=states, trainable=trainable, initial=initial,
                            **merges(copy.deepcopy(base), name, states[-1]))


def merges(model, name: str, adapter: dict[str, torch.Tensor], layouts=None) -> dict[str, dict]:
    """The base weights after `merge_adapter`, after `unmerge_adapter`, and after `merge_and_unload`, of
    `model` (unconverted, or converted: then `layouts` slice the full `adapter`) given the adapter's values."""
    model = with_adapter(model, lora_config(name)) if layouts is None else model
    lay = layouts or {}
    model.load_state_dict({k: lay[k].shard(v) if k in lay else v for k, v in adapter.items()}, strict=False)
    base = lambda: {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}  # noqa: E731
    model.merge_adapter()
    merged = base()
    model.unmerge_adapter()
    unmerged = base()
    model.merge_adapter()
    unloaded = model.merge_and_unload()
    return dict(merged=merged, unmerged=unmerged, unloaded={k: v.detach().clone() for k, v in
                                                            unloaded.state_dict().items()},
                unloaded_layouts=tpkit.shard_layouts(unloaded))


def _rank_run(base, name: str, order: str, final: dict, steps: int = STEPS):
    def body(comm):
        if order == "peft_then_tp":
            model = tpkit.parallelize(with_adapter(copy.deepcopy(base), lora_config(name)), comm=comm)
        else:
            model = with_adapter(tpkit.parallelize(copy.deepcopy(base), comm=comm), lora_config(name))
        layouts = tpkit.shard_layouts(model)
        trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        losses, states = train(model, steps)
        return dict(losses=losses, states=states, layouts=layouts, trainable=trainable,
                    **merges(model, name, final, layouts))
    return body


def compare(results: list[dict], ref: dict) -> list[str]:
    """Every rank's losses and adapter slices after each step against the one-process run (what is off)."""
    bad = []
    for rank, got in enumerate(results):
        assert got["trainable"] == ref["trainable"]
        for step, (loss, want) in enumerate(zip(got["losses"], ref["losses"])):
            if abs(loss - want) > TOL * abs(want):
                bad.append(f"rank {rank} step {step}: loss {loss} vs {want}")
        for step, (state, want) in enumerate(zip(got["states"], ref["states"])):
            assert set(state) == set(want)
            for key, local in state.items():
                err = rel(local, got["layouts"][key].shard(want[key]))
                if not err <= TOL:
                    bad.append(f"rank {rank} step {step}: {key} rel {err:.2e}")
    return bad


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("order", ["tp_then_peft", "peft_then_tp"])
def test_adapter_trains_like_one_process(arch, world, order):
    name, base, ref = arch
    results = tpkit.run_threads(_rank_run(base, name, order, ref["states"][-1]), world)
    bad = compare(results, ref)
    for rank, got in enumerate(results):
        for what in ("merged", "unmerged", "unloaded"):  # the same adapter values, B @ A in another shape:
            lay = got["unloaded_layouts"] if what == "unloaded" else got["layouts"]  # BLAS may round otherwise
            for key, local in got[what].items():
                expect = lay[key].shard(ref[what][key])
                if not rel(local, expect) <= MERGE_TOL:
                    bad.append(f"rank {rank} {what} {key}: rel {rel(local, expect):.2e}")
    assert not bad, f"{name} at {world} ranks ({order}):\n" + "\n".join(bad[:12])
    # whole factors: bit-identical on every rank after every step
    for step in range(STEPS):
        for key, lay in results[0]["layouts"].items():
            if "lora_" in key and lay.is_replicated:
                for other in results[1:]:
                    assert torch.equal(other["states"][step][key], results[0]["states"][step][key]), (step, key)


def test_stock_adapter_files_round_trip(arch, tmp_path):
    """`save_pretrained` on every rank writes one process's files at full size (loaded by PEFT on one plain
    model: equal logits); `PeftModel.from_pretrained(tp_model, dir)` of a stock file gives every rank its slices
    (equal logits); a second adapter loads and switches."""
    name, base, ref = arch
    stock = with_adapter(copy.deepcopy(base), lora_config(name))
    stock.load_state_dict(ref["states"][-1], strict=False)
    stock.save_pretrained(str(tmp_path / "stock"))
    ids = batch(99)
    with torch.no_grad():
        want = stock(input_ids=ids).logits
        plain = copy.deepcopy(base)
        want_base = plain(input_ids=ids).logits

    def body(comm):
        model = tpkit.parallelize(copy.deepcopy(base), comm=comm)
        loaded = peft.PeftModel.from_pretrained(model, str(tmp_path / "stock"))
        out = {}
        with torch.no_grad():
            out["loaded"] = loaded(input_ids=ids).logits
            loaded.save_pretrained(str(tmp_path / "tp"))
            loaded.load_adapter(str(tmp_path / "stock"), adapter_name="second")
            loaded.set_adapter("second")
            out["second"] = loaded(input_ids=ids).logits
            with loaded.disable_adapter():
                out["disabled"] = loaded(input_ids=ids).logits
        return out

    results = tpkit.run_threads(body, 2)
    for got in results:
        assert rel(got["loaded"], want) <= TOL and rel(got["second"], want) <= TOL
        assert rel(got["disabled"], want_base) <= TOL
    import safetensors.torch as st

    written = st.load_file(str(tmp_path / "tp" / "adapter_model.safetensors"))
    expect = st.load_file(str(tmp_path / "stock" / "adapter_model.safetensors"))
    # the file PEFT writes on one process, a targeted LM head's base weight included (save_embedding_layers="auto"),
    # every tensor bit for bit (gathered, not computed)
    assert set(written) == set(expect) and all(torch.equal(written[k], expect[k]) for k in written)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    again = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "tp"))
    with torch.no_grad():
        assert rel(again(input_ids=ids).logits, want) <= TOL


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_training_mode_vocab_parallel_loss(arch, backend):
    """mode="training" (logits split over the vocabulary, `vocab_parallel_cross_entropy`), 3 steps at 2 ranks, on
    thread-ranks and on real gloo processes (`tpkit.launch`)."""
    name, base, ref = arch
    if backend == "gloo" and name != "llama":
        pytest.skip("one architecture through real processes")
    results = tpkit.launch(_training_rank, 2, backend=backend, args=(base, name, 3))
    bad = compare(results, dict(ref, losses=ref["losses"][:3], states=ref["states"][:3]))
    assert not bad, "\n".join(bad[:12])


def _training_rank(base, name: str, steps: int) -> dict:
    """One rank (a thread or a process): convert for training, add the adapter, train `steps` steps."""
    model = with_adapter(tpkit.parallelize(copy.deepcopy(base), mode="training"), lora_config(name))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    losses, states = train(model, steps)
    return dict(losses=losses, states=states, layouts=tpkit.shard_layouts(model), trainable=trainable)


def test_no_collective_added_in_the_forward(arch):
    """The adapter's forward adds no collective: per forward the same all-reduces and all-gathers as the base TP
    model; the backward adds one gradient sum per whole factor."""
    from tpkit.comm import CommProfiler

    name, base, _ = arch
    ids = batch(0)

    def body(comm):
        counts = {}
        for what in ("base", "lora"):
            prof = CommProfiler(comm)
            model = tpkit.parallelize(copy.deepcopy(base), comm=prof)
            if what == "lora":
                model = with_adapter(model, lora_config(name))
            prof._records.clear()
            loss = loss_of(model, ids)
            counts[what, "forward"] = sorted(r.op for r in prof.records)
            prof._records.clear()
            loss.backward()
            counts[what, "backward"] = sorted((r.op, len(r.shape) == 2 and 4 in r.shape) for r in prof.records)
        return counts

    counts = tpkit.run_threads(body, 2)[0]
    assert counts["lora", "forward"] == counts["base", "forward"]
    wrapped = len([k for k in tpkit.plan(base, 2).entries if k.split(".")[-1] in ARCHS[name][1]["target_modules"]])
    factor_sums = [op for op, factor in counts["lora", "backward"] if factor]
    assert factor_sums == ["all_reduce"] * wrapped  # one [r, in] or [out, r] gradient sum per adapted layer
    # and otherwise no more than the base's (the base's first input-gradient all-reduce is skipped when only the
    # adapter trains: nothing before it needs a gradient)
    assert len(counts["lora", "backward"]) - wrapped <= len(counts["base", "backward"])


@pytest.mark.parametrize("bad", ["dora", "embedding", "pissa"])
def test_refused_before_anything_changes(arch, bad):
    """What cannot be split exactly is refused, naming the layer and the way out, in either order, with the model
    left as it was."""
    name, base, _ = arch
    if name != "llama":
        pytest.skip("one architecture")
    over = {"dora": dict(use_dora=True), "embedding": dict(target_modules=["embed_tokens", "q_proj"]),
            "pissa": dict(init_lora_weights="pissa")}[bad]
    said = {"dora": "DoRA", "embedding": "embed", "pissa": "pissa"}[bad]
    # LoRA on an embedding split along the vocabulary works (tests/test_lora_training.py); along its features not
    plan = {"model.embed_tokens": "embedding_colwise"} if bad == "embedding" else "auto"

    def body(comm):
        model = tpkit.parallelize(copy.deepcopy(base), plan=plan, comm=comm)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match=said) as first:
            with_adapter(model, lora_config(name, **over))
        assert "model.layers.0" in str(first.value) or "embed_tokens" in str(first.value)
        assert not [m for m in model.modules() if "Lora" in type(m).__name__]
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        if bad != "pissa":  # on one process PiSSA reads the whole base weight: that adapter converts like any
            wrapped = with_adapter(copy.deepcopy(base), lora_config(name, **over))
            keys = {k: v.clone() for k, v in wrapped.state_dict().items()}
            with pytest.raises(tpkit.PlanError, match=said):
                tpkit.parallelize(wrapped, plan=plan, comm=comm)
            assert all(torch.equal(keys[k], v) for k, v in wrapped.state_dict().items())
            assert tpkit.nn.find_record(wrapped, "test") is None  # nothing was converted
        return True

    assert all(tpkit.run_threads(body, 2))


def test_checkpoint_resumes_the_adapter_at_another_world_size(arch, tmp_path):
    """`tpkit.save_sharded` of the adapter model and its AdamW state after 2 steps at 2 ranks, `load_sharded` at 3
    ranks into a fresh adapter model and optimizer, then step 3: one PEFT process's step 3."""
    name, base, ref = arch
    if name != "llama":
        pytest.skip("one architecture")
    directory = str(tmp_path / "ckpt")

    def make(comm):
        model = with_adapter(tpkit.parallelize(copy.deepcopy(base), comm=comm), lora_config(name), seed=99)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)

    def first(comm):
        model, opt = make(comm)
        model.load_state_dict({k: tpkit.shard_layouts(model)[k].shard(v) for k, v in ref["initial"].items()},
                              strict=False)
        for step in range(2):
            loss_of(model, batch(step)).backward()
            opt.step()
            opt.zero_grad()
        tpkit.save_sharded(model, directory, opt, step=2, comm=comm)

    def second(comm):
        model, opt = make(comm)
        assert tpkit.load_sharded(model, directory, opt, comm=comm)["step"] == 2
        loss = loss_of(model, batch(2))
        loss.backward()
        opt.step()
        return loss.item(), adapter_state(model), tpkit.shard_layouts(model)

    tpkit.run_threads(first, 2)
    for rank, (loss, state, layouts) in enumerate(tpkit.run_threads(second, 3)):
        assert abs(loss - ref["losses"][2]) <= TOL * abs(ref["losses"][2])
        for key, local in state.items():
            assert rel(local, layouts[key].shard(ref["states"][2][key])) <= TOL, (rank, key)


@pytest.mark.parametrize("world", [2, 3])
def test_estimate_and_analyze_count_the_adapter(arch, world):
    """`estimate_memory(peft_model, N, mode="training")`: the base frozen, gradients and AdamW states for the
    adapter only, as many bytes as the fullest rank of the converted adapter holds (at 3 ranks, where different
    tensors are fullest on different ranks, a bound within 10%); `analyze` names each adapter tensor's split."""
    name, base, _ = arch
    peft_model = with_adapter(copy.deepcopy(base), lora_config(name))
    est = tpkit.estimate_memory(peft_model, world, mode="training")
    bare = tpkit.estimate_memory(base, world, mode="training")
    adapter_bytes = [sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)
                     for m in tpkit.run_threads(lambda comm: tpkit.parallelize(copy.deepcopy(peft_model), comm=comm),
                                                world)]
    fullest = max(adapter_bytes)
    assert fullest <= est.per_rank.gradients <= (1.0 if world == 2 else 1.1) * fullest
    assert est.per_rank.optimizer_states == 2 * est.per_rank.gradients  # AdamW's two float64 states
    assert est.per_rank.parameters == bare.per_rank.parameters + est.per_rank.gradients
    assert est.single.gradients == sum(p.numel() * p.element_size() for p in peft_model.parameters()
                                       if p.requires_grad)
    report = tpkit.analyze(peft_model, world_size=world, max_world_size=world)  # the search advises up to `world`
    held = {r.name: r.style for r in report.layers if ".lora_" in r.name}
    assert held and all(s.startswith("lora: ") for s in held.values())
    assert any("rows as the base's" in s for s in held.values())
    assert any("gradient summed" in s for s in held.values())
    assert isinstance(peft_model.base_model.model, type(base))  # the wrappers are back after the analysis
    assert any("Lora" in type(m).__name__ or type(m).__name__ == "Linear" and hasattr(m, "lora_A")
               for m in peft_model.modules())


def _ddp_rank(base, name: str, steps: int) -> dict:
    """tp2 x dp2: the adapter model under DDP over the dp group (only the adapter's gradients are reduced), each
    dp rank on its half of the batch."""
    world = tpkit.get_communicator()
    tp, dp = tpkit.comm.split(world, 2)
    model = with_adapter(tpkit.parallelize(copy.deepcopy(base), comm=tp), lora_config(name))
    layouts = tpkit.shard_layouts(model)
    wrapped = tpkit.data_parallel(model, dp, mode="ddp")
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=LR)
    states = []
    for step in range(steps):
        ids = batch(step).chunk(2)[dp.rank]
        loss_of(wrapped, ids).backward()
        opt.step()
        opt.zero_grad()
        states.append(adapter_state(model))
    return dict(states=states, layouts=layouts)


@pytest.mark.slow
def test_data_parallel_ddp_over_the_adapter(arch):
    """4 gloo processes as tp2 x dp2 under DDP: the adapter after each of 3 steps equals one PEFT process's on the
    whole batch (DDP averages the two half-batch gradients: the whole batch's mean)."""
    name, base, ref = arch
    if name != "llama":
        pytest.skip("one architecture")
    results = tpkit.launch(_ddp_rank, 4, backend="gloo", args=(base, name, 3), timeout=300)
    bad = []
    for rank, got in enumerate(results):
        for step, state in enumerate(got["states"]):
            for key, local in state.items():
                err = rel(local, got["layouts"][key].shard(ref["states"][step][key]))
                if not err <= TOL:
                    bad.append(f"rank {rank} step {step}: {key} rel {err:.2e}")
    assert not bad, "\n".join(bad[:12])
