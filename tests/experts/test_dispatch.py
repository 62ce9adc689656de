"""Expert parallelism on thread-ranks against ONE process of plain transformers (float64, eager experts): forward
losses and every gradient, at several world sizes (3 included), with tp inside the expert group, uneven experts
(6 over 4 ranks), experts that receive no tokens, DeepSeek-V3 (a shared expert, the router's score-correction
bias), the dispatch alone against the experts module on drawn shapes, copies, and bad input refused before
anything changes."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tpkit
from tpkit.comm import groups as make_groups
from tpkit.experts import experts_of
from tpkit.experts.module import DispatchedExperts
from tpkit.convert.families.experts import fused_experts


def qwen3_moe(**over):
    import transformers as tr

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
              decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64, initializer_range=0.2)
    config = tr.Qwen3MoeConfig(**{**kw, **over})
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return tr.AutoModelForCausalLM.from_config(config).double()


def deepseek_v3():
    import transformers as tr

    config = tr.DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6,
                                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                 topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                 qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = tr.AutoModelForCausalLM.from_config(config).double()
    for m in model.modules():  # a trained router's correction bias, so it takes part in the choice
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, m.e_score_correction_bias.numel()))
    return model


@pytest.fixture(scope="module")
def reference():
    """The model, a batch, and one process's loss and gradients on the whole batch."""
    out = {}
    for name, build in (("qwen3", qwen3_moe), ("deepseek", deepseek_v3)):
        model = build()
        ids = torch.randint(0, 64, (12, 10), generator=torch.Generator().manual_seed(1))
        ref = copy.deepcopy(model)
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        out[name] = (model, ids, loss.detach(), {k: p.grad for k, p in ref.named_parameters()})
    return out


def _train_step(model, ids, world: int, tp: int, ep: int):
    """Each rank: convert (tp, experts whole), spread the experts, its dp share of the batch forward and backward;
    the non-expert gradients averaged over dp by hand (what an engine does)."""
    def body(comm):
        g = make_groups(comm, tp=tp, ep=ep)
        m = copy.deepcopy(model)
        if tp > 1:
            m = tpkit.parallelize(m, plan=tpkit.KEEP_EXPERTS_WHOLE, comm=g.tp, mode="training")
        tpkit.expert_parallel(m, g)
        mine = ids.chunk(g.dp.world_size)[g.dp.rank]
        loss = m(input_ids=mine, labels=mine).loss
        loss.backward()
        keys = experts_of(m).keys
        grads = {}
        for k, p in m.named_parameters():
            grad = p.grad
            if k not in keys and g.dp.world_size > 1:
                grad = g.dp.all_reduce(grad) / g.dp.world_size
            grads[k] = grad
        loss = g.dp.all_reduce(loss.detach()) / g.dp.world_size
        return g.ep.rank, g.tp.rank, loss, grads, tpkit.shard_layouts(m)
    return tpkit.run_threads(body, world)


def _check(results, want_loss, want_grads, tol: float = 1e-6):
    """Every rank's loss and gradients against one process's (each rank's part: its TP slices, its experts)."""
    for _, _, loss, grads, layouts in results:
        assert abs(loss.item() - want_loss.item()) < tol * abs(want_loss.item())
        for key, grad in grads.items():
            assert grad is not None, key
            lay = layouts.get(key)
            want = lay.shard(want_grads[key]) if lay is not None else want_grads[key]
            err = ((grad - want).norm() / want.norm().clamp_min(1e-30)).item()
            assert err < tol, (key, err)


@pytest.mark.parametrize("world,tp,ep", [(2, 1, 2), (3, 1, 3), (4, 1, 4), (4, 1, 2), (2, 2, 2), (4, 2, 4),
                                         (4, 2, 2)],
                         ids=["ep2-dp2", "ep3-dp3", "ep4-dp4-uneven", "ep2-dp4", "ep2-tp2", "ep4-tp2xdp2",
                              "ep2-tp2xdp2"])
def test_training_step_equals_one_process(reference, world, tp, ep):
    model, ids, loss, grads = reference["qwen3"]
    _check(_train_step(model, ids, world, tp, ep), loss, grads)


@pytest.mark.parametrize("world,tp,ep", [(2, 1, 2), (4, 2, 4)], ids=["ep2-dp2", "ep4-tp2xdp2"])
def test_deepseek_v3_shared_expert_and_correction_bias(reference, world, tp, ep):
    """The shared expert is an MLP tensor parallelism splits as usual; the router (with its score-correction bias)
    stays whole; only the routed experts are dispatched."""
    model, ids, loss, grads = reference["deepseek"]
    _check(_train_step(model, ids, world, tp, ep), loss, grads)


def _experts_module():
    return qwen3_moe().model.layers[0].mlp.experts


@settings(max_examples=8, deadline=None)
@given(world=st.integers(2, 4), rows=st.integers(0, 9), k=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_dispatch_equals_the_experts_module(world, rows, k, seed):
    """`DispatchedExperts` on each rank's own rows (the ranks hold different tokens) against the experts module run
    whole on the same rows: outputs and the gradients of the rows, the weights and every expert."""
    experts = _experts_module()
    g = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(rows + r, 32, generator=g, dtype=torch.float64) for r in range(world)]
    index = [torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(rows + r)]) if rows + r
             else torch.zeros(0, k, dtype=torch.long) for r in range(world)]
    weights = [torch.rand(rows + r, k, generator=g, dtype=torch.float64) for r in range(world)]

    def body(comm):
        mine = DispatchedExperts(copy.deepcopy(experts), fused_experts(experts), comm, None)
        x, w = hidden[comm.rank].clone().requires_grad_(), weights[comm.rank].clone().requires_grad_()
        out = mine(x, index[comm.rank], w)
        (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        return out.detach(), x.grad, w.grad, mine.gate_up_proj.grad, mine.down_proj.grad, mine.first

    results = tpkit.run_threads(body, world)
    whole = copy.deepcopy(experts)
    xs = [h.clone().requires_grad_() for h in hidden]
    ws = [w.clone().requires_grad_() for w in weights]
    outs = [whole(x, i, w) for x, i, w in zip(xs, index, ws)]
    sum((o * torch.arange(o.numel(), dtype=o.dtype).view_as(o)).sum() for o in outs).backward()
    for r, (out, gx, gw, gup, gdown, first) in enumerate(results):
        torch.testing.assert_close(out, outs[r].detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gx, xs[r].grad if xs[r].grad is not None else torch.zeros_like(gx))
        torch.testing.assert_close(gw, ws[r].grad if ws[r].grad is not None else torch.zeros_like(gw))
        n = gup.shape[0]
        want_up = whole.gate_up_proj.grad if whole.gate_up_proj.grad is not None else torch.zeros_like(
            whole.gate_up_proj)
        want_down = whole.down_proj.grad if whole.down_proj.grad is not None else torch.zeros_like(whole.down_proj)
        torch.testing.assert_close(gup, want_up[first:first + n])
        torch.testing.assert_close(gdown, want_down[first:first + n])


def test_experts_that_receive_no_tokens_take_part_with_zero_gradients():
    """Every token routed to rank 0's experts: rank 1 receives nothing, still runs every collective, and its experts'
    gradients are zeros, never None."""
    experts = _experts_module()

    def body(comm):
        mine = DispatchedExperts(copy.deepcopy(experts), fused_experts(experts), comm, None)
        x = torch.randn(5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(comm.rank))
        index = torch.tensor([[0, 1]] * 5)  # experts 0..2 live on rank 0 (6 over 2 ranks)
        mine(x, index, torch.full((5, 2), 0.5, dtype=torch.float64)).sum().backward()
        return mine.gate_up_proj.grad, mine.down_proj.grad

    (up0, down0), (up1, down1) = tpkit.run_threads(body, 2)
    assert up1 is not None and down1 is not None and not up1.any() and not down1.any()
    assert up0[:2].abs().sum() > 0 and not up0[2].any()  # rank 0's experts 0 and 1 were chosen, expert 2 was not


def test_copies_and_assigned_weights_keep_the_gradient_rule(reference):
    """A deep copy of an expert-parallel model, and one whose weights were replaced by load_state_dict(assign=True),
    still sum expert gradients over the expert-data group and divide by dp: each rank's expert gradients equal its
    experts' slice of one process's on the whole batch (ep2 over dp4: expert-data groups of 2)."""
    model, ids, _, want = reference["qwen3"]
    key = "model.layers.0.mlp.experts.gate_up_proj"

    def body(comm):
        g = make_groups(comm, tp=1, ep=2)
        twin = copy.deepcopy(tpkit.expert_parallel(copy.deepcopy(model), g))
        twin.load_state_dict({k: v.clone() for k, v in twin.state_dict().items()}, assign=True)
        mine = ids.chunk(g.dp.world_size)[g.dp.rank]
        twin(input_ids=mine, labels=mine).loss.backward()
        return tpkit.shard_layouts(twin)[key], twin.get_parameter(key).grad

    for layout, grad in tpkit.run_threads(body, 4):
        expected = layout.shard(want[key])
        assert ((grad - expected).norm() / expected.norm()).item() < 1e-6


def test_a_bf16_checkpoint_loads_and_runs_as_transformers_does(tmp_path):
    """A bf16 Hugging Face checkpoint through `from_pretrained` with the experts spread on the meta model (each rank
    reads its own), the logits of every rank against plain transformers' bf16 model on one process (eager experts),
    within bf16's rounding."""
    import transformers as tr

    qwen3_moe().to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    one = tr.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", experts_implementation="eager")
    assert one.dtype == torch.bfloat16
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = one(input_ids=ids).logits.float()

    def body(comm):
        g = make_groups(comm, tp=2, ep=4)

        def spread(meta):
            tpkit.parallelize(meta, tpkit.KEEP_EXPERTS_WHOLE, comm=g.tp)
            tpkit.expert_parallel(meta, g)

        m = tpkit.from_pretrained(str(tmp_path / "bf16"), comm=g.tp, dtype="auto", convert=spread)
        with torch.no_grad():
            return m.dtype, m(input_ids=ids).logits.float()

    for dtype, logits in tpkit.run_threads(body, 4):
        assert dtype == torch.bfloat16
        err = ((logits - want).norm() / want.norm()).item()
        assert err < 2e-2, err


def test_replica_sentinel_compares_experts_over_their_expert_data_group(reference):
    model, ids, _, _ = reference["qwen3"]

    def body(comm):
        g = make_groups(comm, tp=1, ep=2)  # 4 ranks: experts 0-2 on ranks 0 and 2, 3-5 on ranks 1 and 3
        m = tpkit.expert_parallel(copy.deepcopy(model), g)
        mine = ids.chunk(4)[comm.rank]
        m(input_ids=mine, labels=mine).loss.backward()
        for p in m.parameters():  # the non-expert weights as an engine leaves them: averaged over dp
            if p.grad is not None and p.grad.shape[0] != 3:
                p.grad = g.dp.all_reduce(p.grad) / 4
        report = tpkit.check_replicas(m, comm=g.tp)
        if comm.rank == 2:
            with torch.no_grad():
                m.model.layers[1].mlp.experts.down_proj.add_(1e-3)
        try:
            tpkit.check_replicas(m, comm=g.tp)
        except tpkit.ReplicaError as exc:
            return report, str(exc)
        return report, None

    results = tpkit.run_threads(body, 4)
    assert all(r[0].tensors > 0 for r in results)
    assert all(r[1] is not None for r in results), results
    assert "model.layers.1.mlp.experts.down_proj" in results[0][1] + results[2][1]


def _refused(body, world: int = 2):
    """`body(comm, groups_of)` on thread-ranks; each rank's (exception, whether its model was left as it was)."""
    return tpkit.run_threads(body, world)


@pytest.mark.parametrize("case", ["no-ep", "ep-above-experts", "dense-model", "split-by-tp", "capacity", "twice",
                                  "aux-with-cp", "separate-experts"])
def test_bad_input_is_refused_before_anything_changes(case):
    import transformers as tr
    from tests.models.moe import custom_moe

    def build():
        if case == "dense-model":
            torch.manual_seed(0)
            return tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                                      num_hidden_layers=1, num_attention_heads=4))
        if case == "separate-experts":
            return custom_moe()
        if case == "aux-with-cp":
            return qwen3_moe(output_router_logits=True, router_aux_loss_coef=0.1)
        model = qwen3_moe(num_experts=2 if case == "ep-above-experts" else 6)
        if case == "capacity":
            model.config.capacity_factor = 1.25
        return model

    model = build()

    def body(comm):
        m = copy.deepcopy(model)
        g = make_groups(comm, tp=2 if case == "split-by-tp" else 1, cp=2 if case == "aux-with-cp" else 1,
                        ep=1 if case == "no-ep" else (4 if case == "ep-above-experts" else 2))
        if case == "split-by-tp":
            m = tpkit.parallelize(m, comm=g.tp, mode="training")  # the default plan splits every expert's features
        if case == "twice":
            tpkit.expert_parallel(m, g)
        before = {k: v.clone() for k, v in m.state_dict().items()}
        kinds = [type(x) for x in m.modules()]
        try:
            tpkit.expert_parallel(m, g)
        except (ValueError, NotImplementedError) as exc:
            same = kinds == [type(x) for x in m.modules()] and all(
                torch.equal(v, m.state_dict()[k]) for k, v in before.items())
            return type(exc).__name__, str(exc), same
        return None

    for result in tpkit.run_threads(body, 4):
        assert result is not None, case
        kind, message, same = result
        assert same, (case, message)
        expected = {"no-ep": "ep=E) with E > 1", "ep-above-experts": "fewer than ep 4",
                    "dense-model": "no fused experts module", "split-by-tp": "KEEP_EXPERTS_WHOLE",
                    "capacity": "capacity_factor=1.25", "twice": "expert-parallel already",
                    "aux-with-cp": "context parallelism (cp 2)", "separate-experts": "separate"}[case]
        assert expected in message, (case, message)


@pytest.mark.parametrize("world,tp,ep,why", [(4, 2, 3, "not a multiple of tp 2"), (4, 1, 3, "does not divide"),
                                             (6, 2, 4, "does not divide")])
def test_an_ep_that_cannot_be_carved_names_the_choices(world, tp, ep, why):
    def body(comm):
        with pytest.raises(ValueError) as info:
            make_groups(comm, tp=tp, ep=ep)
        return str(info.value)

    for message in tpkit.run_threads(body, world):
        assert why in message and "choose ep among" in message, message


@pytest.mark.parametrize("world,tp,ep", [(2, 1, 2), (4, 2, 4), (4, 1, 2)], ids=["ep2-dp2", "ep4-tp2xdp2", "ep2-dp4"])
def test_router_bias_moves_on_the_global_counts(reference, world, tp, ep):
    """DeepSeek-V3's balancing by bias: every rank's bias moves as one process's would on the whole batch's counts
    (the reference counts the router's own choices, hooked in plain transformers)."""
    from tpkit import update_expert_bias

    model, ids, _, _ = reference["deepseek"]
    ref, counts = copy.deepcopy(model), {}
    for name, m in ref.named_modules():
        if hasattr(m, "e_score_correction_bias"):
            m.register_forward_hook(lambda mod, a, out, name=name: counts.__setitem__(name, torch.bincount(
                out[2].reshape(-1), minlength=6)))
    ref(input_ids=ids)
    want = {n: ref.get_submodule(n).e_score_correction_bias + 0.01 * torch.sign(c.double().mean() - c.double())
            for n, c in counts.items()}

    def body(comm):
        g = make_groups(comm, tp=tp, ep=ep)
        m = copy.deepcopy(model)
        if tp > 1:
            m = tpkit.parallelize(m, plan=tpkit.KEEP_EXPERTS_WHOLE, comm=g.tp, mode="training")
        tpkit.expert_parallel(m, g).train()
        mine = ids.chunk(g.dp.world_size)[g.dp.rank]
        m(input_ids=mine)
        loads = update_expert_bias(m, rate=0.01)
        return {n: m.get_submodule(n).e_score_correction_bias.clone() for n in want}, loads

    for biases, loads in tpkit.run_threads(body, world):
        assert [v.tolist() for v in loads.values()] == [c.tolist() for c in counts.values()]  # one MoE layer
        for name, bias in biases.items():
            torch.testing.assert_close(bias, want[name], rtol=0, atol=1e-12)


def test_lora_on_the_fused_experts_is_refused_naming_it(reference):
    """PEFT's LoRA on the 3-D expert weights (target_parameters) of an expert-parallel model stops at the first
    forward; LoRA on the attention trains, the experts frozen and dispatched as before."""
    import peft

    model, ids, _, _ = reference["qwen3"]

    def body(comm):
        g = make_groups(comm, tp=1, ep=2)
        out = []
        for config in (peft.LoraConfig(r=2, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"]),
                       peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"])):
            m = peft.get_peft_model(tpkit.expert_parallel(copy.deepcopy(model), g), config)
            mine = ids.chunk(2)[comm.rank]
            try:
                m(input_ids=mine, labels=mine).loss.backward()
                out.append(sorted(n for n, p in m.named_parameters() if p.grad is not None)[:1])
            except NotImplementedError as exc:
                out.append(str(exc))
        return out

    for refused, trained in tpkit.run_threads(body, 2):
        assert "target_parameters" in refused and "LoRA" in refused, refused
        assert trained and "lora_A" in trained[0], trained


def test_from_pretrained_reads_only_each_ranks_experts(reference, tmp_path, monkeypatch):
    """`from_pretrained(..., convert=)` spreading the experts on the meta model: each rank reads its experts' slices
    of the checkpoint (6 experts over 4 ranks: 2, 2, 1, 1), and holds exactly those values."""
    import tpkit.checkpoint.pretrained as pretrained

    model, _, _, _ = reference["qwen3"]
    model.save_pretrained(tmp_path / "moe")
    whole = {k: v for k, v in model.state_dict().items()}
    read: dict[int, dict[str, int]] = {}
    real = pretrained.read_targets

    def counting(source, targets, *args, **kwargs):
        read[threading.get_ident()] = {t.name: t.layout.local_numel for t in targets}
        return real(source, targets, *args, **kwargs)

    monkeypatch.setattr(pretrained, "read_targets", counting)

    def body(comm):
        g = make_groups(comm, tp=1, ep=4)

        def spread(meta):
            tpkit.expert_parallel(meta, g)

        m = tpkit.from_pretrained(str(tmp_path / "moe"), comm=g.tp, dtype=torch.float64, convert=spread,
                                  experts_implementation="eager")
        return threading.get_ident(), g.ep.rank, {k: v.clone() for k, v in m.state_dict().items()}

    for ident, ep_rank, state in tpkit.run_threads(body, 4):
        first, count = [0, 2, 4, 5][ep_rank], [2, 2, 1, 1][ep_rank]
        for key in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
            assert read[ident][key] == whole[key][first:first + count].numel(), key
            torch.testing.assert_close(state[key], whole[key][first:first + count], rtol=0, atol=0)
