"""LoRA under TP with the rest of training, against ONE process of plain transformers + PEFT (issue 37).

Llama (8 query / 2 KV heads, a vocabulary of 103 that 2 and 3 do not divide), float64, rel 1e-9, at 2 and 3 ranks:

- lora_dropout > 0: the TP ranks draw one mask (`tpkit.nn.lora_dropout`): every whole factor bit-identical on every
  rank after every step (`tpkit.check_replicas`), and the run equals one PEFT process whose default generator
  starts where the TP ranks' replicated stream does (the same masks); threads, and gloo processes (slow);
- `Checkpointer`: adapter, AdamW state and dropout stream saved at 2 ranks, resumed at 3, the steps after equal;
- FSDP2 over the adapter, tp2 x dp2 on 4 gloo processes (slow);
- `recompute` "full" / "selective" with dropout: gradients equal, bit for bit, no recompute's;
- `modules_to_save=["lm_head"]`: the copy split as the original, in either order (a classifier head kept whole:
  the copy whole);
- LoRA on the vocabulary-parallel embedding, in either order: training, merge, stock files both ways, estimate;
- `torch.compile(fullgraph=True)` with dropout and the embedding adapter, forward and backward (slow).
"""
from __future__ import annotations

import copy

import pytest
import torch

import tpkit
from tests.test_lora import (_LOCK, ARCHS, LR, TOL, adapter_state, batch, compare, lora_config, loss_of, rel,
                              with_adapter)

peft = pytest.importorskip("peft")

SEED, DROP_STEPS = 11, 4


@pytest.fixture(scope="module")
def llama():
    return ARCHS["llama"][0]()


def _steps(model, steps: int, check=None, state=adapter_state) -> dict:
    """Losses and the adapter (`state(model)`) after each AdamW step; `check(model)` after each backward."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, states = [], []
    for step in range(steps):
        loss = loss_of(model, batch(step))
        loss.backward()
        if check is not None:
            check(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        states.append(state(model))
    return dict(losses=losses, states=states,
                trainable=sorted(n for n, p in model.named_parameters() if p.requires_grad))


@pytest.fixture(scope="module")
def dropout_reference(llama):
    """One PEFT process, lora_dropout=0.1, its default generator seeded as the TP ranks' replicated stream."""
    ref = with_adapter(copy.deepcopy(llama), lora_config("llama", lora_dropout=0.1)).train()
    initial = adapter_state(ref)
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        return dict(_steps(ref, DROP_STEPS), initial=initial)


def _dropout_rank(base) -> dict:
    """One rank (a thread or a process): the adapter with lora_dropout=0.1, the replicated stream seeded SEED."""
    comm = tpkit.get_communicator()
    model = with_adapter(tpkit.parallelize(copy.deepcopy(base), comm=comm), lora_config("llama", lora_dropout=0.1))
    model.train()
    with _LOCK:  # it also seeds the default generator, which thread-ranks share with PEFT's draws
        tpkit.nn.model_parallel_manual_seed(SEED, comm)
    checked = []
    out = _steps(model, DROP_STEPS, check=lambda m: checked.append(tpkit.check_replicas(m)))
    return dict(out, layouts=tpkit.shard_layouts(model), checked=len(checked))


@pytest.mark.parametrize("world,backend", [(2, "threads"), (3, "threads"),
                                           pytest.param(2, "gloo", marks=pytest.mark.slow)])
def test_lora_dropout_one_mask_for_all_ranks(llama, dropout_reference, world, backend):
    """Equal to one process (rel 1e-9) step by step, and `check_replicas` (parameters and gradients) after every
    backward. Note: mismatched masks would not show as replicas differing (every whole factor's gradient is
    summed, so replicas stay equal while the model they hold is wrong); the one-process comparison shows it."""
    with torch.random.fork_rng():
        results = tpkit.launch(_dropout_rank, world, backend=backend, args=(llama,))
    assert all(r["checked"] == DROP_STEPS for r in results)  # check_replicas raised on no step
    bad = compare(results, dropout_reference)
    assert not bad, "\n".join(bad[:12])
    for step in range(DROP_STEPS):  # whole factors bit-identical on every rank after every step
        for key, lay in results[0]["layouts"].items():
            if "lora_" in key and lay.is_replicated:
                assert all(torch.equal(r["states"][step][key], results[0]["states"][step][key]) for r in results)
    plain = with_adapter(copy.deepcopy(llama), lora_config("llama")).train()  # the masks did something
    assert abs(loss_of(plain, batch(0)).item() - dropout_reference["losses"][0]) > 1e-6


def test_lora_dropout_without_a_seeded_stream_is_refused(llama):
    def body(comm):
        model = with_adapter(tpkit.parallelize(copy.deepcopy(llama), comm=comm),
                             lora_config("llama", lora_dropout=0.1)).train()
        with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj adapter 'default'.*model_parallel_manual"):
            loss_of(model, batch(0))
        wrapped = tpkit.parallelize(with_adapter(copy.deepcopy(llama), lora_config("llama", lora_dropout=0.1)),
                                    comm=comm).train()
        with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj adapter 'default'.*model_parallel_manual"):
            loss_of(wrapped, batch(0))
        return True

    assert all(tpkit.run_threads(body, 2))


def _checkpointer_rank(base, directory: str, stop: int, initial: dict) -> dict:
    """Train the dropout adapter under a `Checkpointer` (every 2 steps) from wherever it resumes up to `stop`."""
    comm = tpkit.get_communicator()
    model = with_adapter(tpkit.parallelize(copy.deepcopy(base), comm=comm), lora_config("llama", lora_dropout=0.1),
                         seed=99)  # a different init: the resume must overwrite it
    model.train()
    with _LOCK:
        tpkit.nn.model_parallel_manual_seed(SEED + 1, comm)  # a different stream: the resume must restore it
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    ckpt = tpkit.Checkpointer(directory, every=2, comm=comm)
    start = ckpt.resume(model, opt)
    if start == 0:  # the first run starts from the reference's seeds
        with _LOCK:
            tpkit.nn.model_parallel_manual_seed(SEED, comm)
        model.load_state_dict({k: tpkit.shard_layouts(model)[k].shard(v) for k, v in initial.items()}, strict=False)
    losses, states = [], []
    for step in range(start, stop):
        loss = loss_of(model, batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        states.append(adapter_state(model))
        ckpt.maybe_save(step + 1, model, opt)
    return dict(start=start, losses=losses, states=states, layouts=tpkit.shard_layouts(model),
                trainable=sorted(n for n, p in model.named_parameters() if p.requires_grad))



@pytest.mark.filterwarnings("ignore:Checkpointer")
def test_checkpointer_resumes_adapter_optimizer_and_dropout_at_another_world_size(llama, dropout_reference,
                                                                                   tmp_path):
    """`Checkpointer` saves the dropout adapter and its AdamW state after 2 steps at 2 ranks; a fresh run at 3 ranks
    (another init, another stream) resumes at step 2 and continues: steps 3 and 4 equal one PEFT process's (the
    replicated dropout stream, the same on every saved rank, is restored at the new world size)."""
    directory = str(tmp_path / "ckpt")
    with torch.random.fork_rng():
        first = tpkit.launch(_checkpointer_rank, 2, backend="threads",
                             args=(llama, directory, 2, dropout_reference["initial"]))
        second = tpkit.launch(_checkpointer_rank, 3, backend="threads", args=(llama, directory, DROP_STEPS, {}))
    assert [r["start"] for r in first] == [0, 0] and [r["start"] for r in second] == [2, 2, 2]
    ref = dropout_reference
    assert not compare(first, dict(ref, losses=ref["losses"][:2], states=ref["states"][:2]))
    bad = compare(second, dict(ref, losses=ref["losses"][2:], states=ref["states"][2:]))
    assert not bad, "\n".join(bad[:12])


def _fsdp_rank(base, steps: int) -> dict:
    """tp2 x dp2: the adapter model under FSDP2 over the dp group (every parameter sharded over dp, the frozen base
    included; only the adapter's gradients are reduce-scattered), each dp rank on its half of the batch."""
    from torch.distributed.tensor import DTensor

    world = tpkit.get_communicator()
    tp, dp = tpkit.comm.split(world, 2)
    model = with_adapter(tpkit.parallelize(copy.deepcopy(base), comm=tp), lora_config("llama"))
    layouts = tpkit.shard_layouts(model)
    wrapped = tpkit.data_parallel(model, dp, mode="fsdp")
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=LR)
    states = []
    for step in range(steps):
        loss_of(wrapped, batch(step).chunk(2)[dp.rank]).backward()
        opt.step()
        opt.zero_grad()
        states.append({k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                       for k, v in model.state_dict().items() if "lora_" in k})  # this TP rank's whole slice
    return dict(states=states, layouts=layouts, sharded=isinstance(next(model.parameters()), DTensor))


@pytest.fixture(scope="module")
def plain_reference(llama):
    """One PEFT process, no dropout: the adapter after each of 3 AdamW steps on the whole batch."""
    return _steps(with_adapter(copy.deepcopy(llama), lora_config("llama")), 3)


@pytest.mark.slow
def test_fsdp2_over_the_adapter(llama, plain_reference):
    """4 gloo processes as tp2 x dp2 under FSDP2 (`tpkit.data_parallel(model, dp, mode="fsdp")`): the adapter after
    each of 3 steps equals one PEFT process's on the whole batch."""
    results = tpkit.launch(_fsdp_rank, 4, backend="gloo", args=(llama, 3), timeout=300)
    assert all(r["sharded"] for r in results)
    bad = compare([dict(r, losses=[], trainable=plain_reference["trainable"]) for r in results], plain_reference)
    assert not bad, "\n".join(bad[:12])


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def dropout_grads(llama):
    """One PEFT process, lora_dropout=0.1, default generator seeded SEED: the adapter's gradients of one batch."""
    ref = with_adapter(copy.deepcopy(llama), lora_config("llama", lora_dropout=0.1)).train()
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        loss_of(ref, batch(0)).backward()
    return _grads(ref)


@pytest.mark.parametrize("world", [2, 3])
def test_recompute_with_an_adapter(llama, dropout_grads, world):
    """`tpkit.recompute(model, "full" | "selective")` on the PEFT model with lora_dropout=0.1: the adapter's gradients
    equal one PEFT process's (rel 1e-9) and, bit for bit, the same TP run's without recompute (the recompute replays
    the tracker, so the adapter's dropout draws its masks again)."""
    def body(comm):
        out = {}
        for policy in ("none", "full", "selective"):
            model = with_adapter(tpkit.parallelize(copy.deepcopy(llama), comm=comm),
                                 lora_config("llama", lora_dropout=0.1)).train()
            tpkit.recompute(model, policy)
            calls = []
            a = model.get_submodule("base_model.model.model.layers.0.mlp.down_proj.lora_A.default")
            a.register_forward_hook(lambda *_: calls.append(1))  # the recompute stops inside down_proj, after A
            with _LOCK:
                tpkit.nn.model_parallel_manual_seed(SEED, comm)
            loss_of(model, batch(0)).backward()
            out[policy], out[policy, "calls"] = _grads(model), len(calls)
        return dict(out, layouts=tpkit.shard_layouts(model))

    with torch.random.fork_rng():
        results = tpkit.run_threads(body, world)
    for rank, got in enumerate(results):
        assert (got["none", "calls"], got["full", "calls"]) == (1, 2)  # "full" ran the adapted layer again
        for policy in ("full", "selective"):
            assert all(torch.equal(got[policy][n], g) for n, g in got["none"].items()), (rank, policy)
        for n, g in got["none"].items():
            assert rel(g, got["layouts"][n].shard(dropout_grads[n])) <= TOL, (rank, n)


def _trained_state(model) -> dict[str, torch.Tensor]:
    """The adapter and the trained copies of `modules_to_save`."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k or "modules_to_save" in k}


@pytest.fixture(scope="module")
def saved_reference(llama, tmp_path_factory):
    """One PEFT process with modules_to_save=["lm_head"]: 3 AdamW steps, then its stock adapter files."""
    ref = with_adapter(copy.deepcopy(llama), lora_config("llama", modules_to_save=["lm_head"]))
    out = _steps(ref, 3, state=_trained_state)
    directory = tmp_path_factory.mktemp("saved") / "stock"
    ref.save_pretrained(str(directory))
    with torch.no_grad():
        logits = ref(input_ids=batch(9)).logits
    return dict(out, files=str(directory), logits=logits)


@pytest.mark.parametrize("world", [2, 3])
def test_modules_to_save_follows_the_original_split(llama, saved_reference, world, tmp_path):
    """modules_to_save=["lm_head"] (PEFT trains a copy of the LM head): in either order the copy is split as the
    original (rows over the vocabulary of 103, which 2 and 3 do not divide), `shard_layouts` gives both the
    original's layout, 3 AdamW steps equal one PEFT process's (rel 1e-9), `save_pretrained` writes the stock file,
    and the stock file loads onto a TP model (`PeftModel.from_pretrained`), each rank taking its slice of the copy."""
    import safetensors.torch as st

    def body(comm):
        out = {}
        for order in ("tp_then_peft", "peft_then_tp"):
            config = lora_config("llama", modules_to_save=["lm_head"])
            if order == "tp_then_peft":
                model = with_adapter(tpkit.parallelize(copy.deepcopy(llama), comm=comm), config)
            else:
                model = tpkit.parallelize(with_adapter(copy.deepcopy(llama), config), comm=comm)
            head = model.base_model.model.lm_head
            assert type(head.modules_to_save["default"]) is type(head.original_module) is tpkit.ColumnParallelLinear
            out[order] = dict(_steps(model, 3, state=_trained_state), layouts=tpkit.shard_layouts(model))
            model.save_pretrained(str(tmp_path / order))
        loaded = peft.PeftModel.from_pretrained(tpkit.parallelize(copy.deepcopy(llama), comm=comm),
                                                saved_reference["files"])  # the full copy: each rank its slice
        with torch.no_grad():
            out["loaded"] = loaded(input_ids=batch(9)).logits
        return out

    results = tpkit.run_threads(body, world)
    want = st.load_file(f"{saved_reference['files']}/adapter_model.safetensors")
    for order in ("tp_then_peft", "peft_then_tp"):
        bad = compare([r[order] for r in results], saved_reference)
        assert not bad, f"{order}:\n" + "\n".join(bad[:12])
        written = st.load_file(str(tmp_path / order / "adapter_model.safetensors"))
        assert set(written) == set(want) and "base_model.model.lm_head.weight" in want  # the copy, at full size
        assert all(rel(written[k], want[k]) <= TOL for k in want), order
    assert all(rel(r["loaded"], saved_reference["logits"]) <= TOL for r in results)


EMBED_TARGETS = dict(target_modules=["embed_tokens", "q_proj", "down_proj"])


@pytest.fixture(scope="module")
def embedding_reference(llama, tmp_path_factory):
    """One PEFT process with LoRA on the embedding too: 3 AdamW steps, its merged weights, its stock files."""
    ref = with_adapter(copy.deepcopy(llama), lora_config("llama", **EMBED_TARGETS))
    out = _steps(ref, 3)
    directory = tmp_path_factory.mktemp("embedding") / "stock"
    ref.save_pretrained(str(directory))
    merged = {k: v.detach().clone() for k, v in ref.merge_and_unload().state_dict().items()}
    return dict(out, files=str(directory), merged=merged)


@pytest.mark.parametrize("world", [2, 3])
def test_lora_on_the_vocabulary_parallel_embedding(llama, embedding_reference, world, tmp_path):
    """LoRA on `embed_tokens` (VocabParallelEmbedding, a vocabulary of 103 that 2 and 3 do not divide): A split
    along the vocabulary like the base, B whole; in either order 3 AdamW steps equal one PEFT process's (rel 1e-9),
    `merge_and_unload` leaves each rank the slice of PEFT's merged table, `save_pretrained` writes the stock file,
    a stock file loads onto the TP model, and `estimate_memory` counts the adapter as the fullest rank holds it."""
    import safetensors.torch as st

    def body(comm):
        out = {}
        for order in ("tp_then_peft", "peft_then_tp"):
            config = lora_config("llama", **EMBED_TARGETS)
            if order == "tp_then_peft":
                model = with_adapter(tpkit.parallelize(copy.deepcopy(llama), comm=comm), config)
            else:
                model = tpkit.parallelize(with_adapter(copy.deepcopy(llama), config), comm=comm)
            assert type(model.base_model.model.model.embed_tokens).__name__ == "VocabParallelLoraEmbedding"
            out[order] = dict(_steps(model, 3), layouts=tpkit.shard_layouts(model))
            out[order, "bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
            model.save_pretrained(str(tmp_path / order))
            model.load_adapter(embedding_reference["files"], adapter_name="stock")  # a stock file: each rank its slices
            model.set_adapter("stock")
            with torch.no_grad():
                out[order, "stock"] = model(input_ids=batch(9)).logits
            model.set_adapter("default")
            unloaded = model.merge_and_unload(adapter_names=["default"])
            out[order, "merged"] = (unloaded.state_dict(), tpkit.shard_layouts(unloaded))
        return out

    results = tpkit.run_threads(body, world)
    want = st.load_file(f"{embedding_reference['files']}/adapter_model.safetensors")
    for order in ("tp_then_peft", "peft_then_tp"):
        bad = compare([r[order] for r in results], embedding_reference)
        assert not bad, f"{order}:\n" + "\n".join(bad[:12])
        for r in results:
            merged, layouts = r[order, "merged"]
            key = "model.embed_tokens.weight"
            assert rel(merged[key], layouts[key].shard(embedding_reference["merged"][key])) <= TOL
        written = st.load_file(str(tmp_path / order / "adapter_model.safetensors"))
        # the file one PEFT process writes: the base table too (save_embedding_layers="auto"), every adapter tensor
        assert set(written) == set(want) and any("lora_embedding_A" in k for k in written)
        assert all(rel(written[k], want[k]) <= TOL for k in written), order
    # estimate_memory counts the embedding's adapter: the fullest rank's gradient bytes
    plain = with_adapter(copy.deepcopy(llama), lora_config("llama", **EMBED_TARGETS))
    fullest = max(r["tp_then_peft", "bytes"] for r in results)
    assert tpkit.estimate_memory(plain, world, mode="training").per_rank.gradients == fullest
    again = peft.PeftModel.from_pretrained(copy.deepcopy(llama), str(tmp_path / "tp_then_peft"))
    stock = peft.PeftModel.from_pretrained(copy.deepcopy(llama), embedding_reference["files"])
    with torch.no_grad():
        want_logits = stock(input_ids=batch(9)).logits
        assert rel(again(input_ids=batch(9)).logits, want_logits) <= TOL
    assert all(rel(r[o, "stock"], want_logits) <= TOL for r in results for o in ("tp_then_peft", "peft_then_tp"))


def _compile_rank(base, ids: torch.Tensor) -> dict:
    """This rank's compiled (fullgraph, aot_eager) PEFT model with lora_dropout=0.1: logits and the adapter's
    gradients."""
    comm = tpkit.get_communicator()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    model = with_adapter(tpkit.parallelize(copy.deepcopy(base), comm=comm),
                         lora_config("llama", lora_dropout=0.1, **EMBED_TARGETS)).train()
    with _LOCK:
        tpkit.nn.model_parallel_manual_seed(SEED, comm)
    logits = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids).logits
    logits.square().mean().backward()
    return dict(logits=logits.detach(), grads=_grads(model), layouts=tpkit.shard_layouts(model))


@pytest.mark.slow
def test_torch_compile_fullgraph_with_an_adapter(llama):
    """`torch.compile(peft_tp_model, fullgraph=True)` (LoRA on the embedding, attention and MLP, lora_dropout=0.1;
    fullgraph raises on any graph break: the one-mask draw is a custom op) at 2 thread-ranks: logits and the
    adapter's gradients equal one eager PEFT process's with the same masks."""
    ids = batch(0)
    ref = with_adapter(copy.deepcopy(llama), lora_config("llama", lora_dropout=0.1, **EMBED_TARGETS)).train()
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        want = ref(input_ids=ids).logits
    want.square().mean().backward()
    grads = _grads(ref)
    with torch.random.fork_rng():
        results = tpkit.launch(_compile_rank, 2, backend="threads", args=(llama, ids))
    for got in results:
        assert rel(got["logits"], want.detach()) <= TOL
        assert set(got["grads"]) == set(grads)
        for n, g in got["grads"].items():
            assert rel(g, got["layouts"][n].shard(grads[n])) <= TOL, n


@pytest.fixture(scope="module")
def classifier():
    """A tiny Llama sequence classifier (3 labels): PEFT's SEQ_CLS task trains a copy of its `score` head."""
    import transformers as tr

    from tests.test_lora import _DEC

    config = tr.LlamaConfig(**_DEC, num_labels=3, pad_token_id=0)
    config._attn_implementation = "sdpa"
    with _LOCK:
        torch.manual_seed(5)
        return tr.LlamaForSequenceClassification(config).double()


def _classifier_steps(model, steps: int = 3) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(steps):
        loss = model(input_ids=batch(step), labels=torch.tensor([0, 2])).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("world", [2, 3])
def test_modules_to_save_on_a_classifier_head(classifier, world):
    """task_type="SEQ_CLS" (PEFT adds modules_to_save=["classifier", "score"]): the head, kept whole by the
    planner, and its trained copy stay whole; in either order 3 AdamW steps' losses equal one PEFT process's."""
    config = lambda: peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, init_lora_weights=False,  # noqa: E731
                                     target_modules=["q_proj", "o_proj"])
    want = _classifier_steps(with_adapter(copy.deepcopy(classifier), config()))

    def body(comm):
        a = with_adapter(tpkit.parallelize(copy.deepcopy(classifier), comm=comm), config())
        b = tpkit.parallelize(with_adapter(copy.deepcopy(classifier), config()), comm=comm)
        assert tpkit.shard_layouts(b)["base_model.model.score.modules_to_save.default.weight"].is_replicated
        return _classifier_steps(a), _classifier_steps(b)

    for losses in tpkit.run_threads(body, world):
        for got in losses:
            assert all(abs(g - w) <= TOL * abs(w) for g, w in zip(got, want)), (got, want)
