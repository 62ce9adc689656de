"""Mixture-of-experts models converted by `parallelize`: fused 3-D experts split inside every expert
(`experts_tp`, automatic) or divided over the ranks (`experts_ep`), router whole. Float64 logits and one SGD
step (the model's own loss, router auxiliary loss included) equal the single-device model's at world sizes 2
and 3, on thread-ranks and on gloo processes."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import tpkit  # noqa: E402
from tpkit.convert import PlanError  # noqa: E402

from .moe import BUILDERS, mixtral, qwen2_moe, rank_check  # noqa: E402

TOL = 1e-6
EP = {"model.layers.*.mlp.experts": "experts_ep"}


def _assert(name: str, results: list) -> None:
    for rank, r in enumerate(results):
        assert r["logit_err"] < TOL, f"{name} rank {rank}: logits rel err {r['logit_err']:.2e}"
        assert r["step_err"] < TOL, f"{name} rank {rank}: SGD update rel err {r['step_err']:.2e} ({r['worst']})"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_experts_tp_threads(name, world, moe_reference):
    over = {"output_router_logits": True, "router_aux_loss_coef": 0.1}
    ref = moe_reference(name, **over)
    results = tpkit.launch(rank_check, world, backend="threads", args=(name, ref, over))
    _assert(name, results)
    assert results[0]["styles"]["model.layers.0.mlp.experts"] == "experts_tp"
    assert results[0]["styles"]["model.layers.0.mlp.gate"] == "replicate"


@pytest.mark.parametrize("world", [2, 3])  # Mixtral's 8 experts on 3 ranks: 3, 3, 2
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_experts_ep_threads(name, world, moe_reference):
    ref = moe_reference(name)
    results = tpkit.launch(rank_check, world, backend="threads", args=(name, ref, None, EP))
    _assert(name, results)
    assert results[0]["styles"]["model.layers.0.mlp.experts"] == "experts_ep"


def _gloo_body(refs: dict, custom_ref: dict) -> dict:
    from .moe import custom_check

    out = {n: rank_check(n, refs[n]) for n in refs}
    out["ep"] = rank_check("mixtral", refs["mixtral"], None, EP)
    out["custom"] = custom_check(custom_ref)
    return out


@pytest.mark.slow
def test_gloo_world_size_2(moe_reference):
    """Real processes: both fused models (experts_tp), Mixtral with experts_ep, the separate-Linear MoE."""
    from .moe import custom_check

    refs = {n: moe_reference(n) for n in BUILDERS}
    results = tpkit.launch(_gloo_body, 2, backend="gloo", args=(refs, custom_check(None)), timeout=240)
    for name in results[0]:
        _assert(name, [r[name] for r in results])


def test_mixtral_share_at_tp2(moe_reference):
    """Per-rank parameter share (sum of local numel over the full numel of every state_dict tensor)."""
    ref = moe_reference("mixtral")
    shares = [r["share"] for r in tpkit.launch(rank_check, 2, backend="threads", args=("mixtral", ref))]
    assert max(shares) <= 0.60, shares


def test_expert_layouts_two_pieces_and_round_trip():
    """gate_up is two pieces (gate, up), each split on its own; shard / unshard give the full tensors back."""
    from tpkit.convert.families.experts import expert_layouts

    m = mixtral().model.layers[0].mlp.experts
    for ep in (False, True):
        lays = [expert_layouts(m, 3, r, ep) for r in range(3)]
        for key in ("gate_up_proj", "down_proj"):
            full = getattr(m, key).detach()
            assert torch.equal(lays[0][key].unshard([l[key].shard(full) for l in lays]), full)
    tp = expert_layouts(m, 2, 1, False)["gate_up_proj"]
    assert tp.dim == 1 and tp.segments() == [(24, 48), (72, 96)]  # rank 1: second half of gate, then of up
    assert expert_layouts(m, 3, 2, True)["down_proj"].segments() == [(6, 8)]


def test_one_all_reduce_per_experts_forward():
    """The experts' partial sums are combined first and reduced once, whatever the number of experts hit."""
    from tpkit.comm import traceable

    base = mixtral().model.layers[0].mlp
    x = torch.randn(10, 48, generator=torch.Generator().manual_seed(0))
    calls: list = []
    real = traceable.all_reduce

    def counting(t, comm, *a, **k):
        if comm.backend != "shapes":  # the conversion's dry run moves no data
            calls.append(comm.rank)
        return real(t, comm, *a, **k)

    import copy
    copies = [copy.deepcopy(base) for _ in range(2)]

    def body():
        comm = tpkit.get_communicator()
        block = tpkit.parallelize(copies[comm.rank], plan={"experts": "experts_tp", "gate": "replicate"}, comm=comm,
                                  example_inputs=(x[None],))
        return block(x[None])

    traceable.all_reduce = counting
    try:
        outs = tpkit.launch(body, 2, backend="threads")
    finally:
        traceable.all_reduce = real
    assert torch.allclose(outs[0], base(x[None]), rtol=1e-5, atol=1e-6)
    assert sorted(calls) == [0, 1]  # one all-reduce per rank for 8 experts, 2 per token


def test_too_many_ranks_is_refused_with_the_fix():
    m = qwen2_moe()  # 6 experts, 24 intermediate features each
    with pytest.raises(PlanError, match="experts_tp"):
        tpkit.parallelize(m, plan=EP, comm=_world(8))
    assert m.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 6  # nothing changed
    p = tpkit.plan(m, 32)
    assert p["model.layers.0.mlp.experts"] == "replicate"
    assert "experts_ep" in p.reasons["model.layers.0.mlp.experts"]


def _world(n: int):
    """A communicator that only says its size (planning and checks run before any communication)."""
    class Fake:
        world_size, rank = n, 0
    return Fake()


@pytest.mark.parametrize("world", [2, 3])
def test_separate_linear_experts_one_region(world):
    """Experts as separate nn.Linear modules: the block is one region (moe_block), expert projections split
    without communication, the router whole; the router logits also feed an auxiliary loss."""
    from .moe import custom_check

    ref = custom_check(None)
    results = tpkit.launch(custom_check, world, backend="threads", args=(ref,))
    _assert("custom MoE", results)
    styles = results[0]["styles"]
    assert styles["moes.0"] == "moe_block"
    assert styles["moes.0.experts.4.w1"] == "expert_colwise" and styles["moes.0.experts.4.w2"] == "expert_rowwise"
    assert styles["moes.0.gate"] == "replicate"


def test_block_with_a_residual_inside_is_left_whole_with_the_reason():
    from .moe import custom_moe

    p = tpkit.plan(custom_moe(residual_inside=True), 2)
    assert "moes.0" not in p.entries and p["moes.0.experts.0.w2"] != "expert_rowwise"
    assert "not the sum of its experts' partial outputs" in p.reasons["moes.0"]


def test_region_layers_refuse_to_run_outside_their_region():
    """A plan naming the experts' projections but not their block would return partial sums: it fails loudly,
    in the conversion's dry run, before anything changes."""
    from tpkit.convert.errors import PlanError

    from .moe import custom_moe

    def body():
        with pytest.raises(PlanError, match="moe_block"):
            tpkit.parallelize(custom_moe(), plan={"entries": {"moes.*.experts.*.w1": "expert_colwise"}},
                              comm=tpkit.get_communicator())
        return True

    assert all(tpkit.launch(body, 2, backend="threads"))


def test_recorded_plan_replays_the_region():
    """model.tp_plan keeps the moe_block entry, so applying it to a fresh model converts the same way."""
    from .moe import custom_check, custom_moe

    def record():
        return tpkit.parallelize(custom_moe(), comm=tpkit.get_communicator()).tp_plan

    plan = tpkit.launch(record, 2, backend="threads")[0]
    assert plan["moes.1"] == "moe_block"
    ref = custom_check(None)
    _assert("custom MoE (replayed plan)", tpkit.launch(custom_check, 2, backend="threads", args=(ref, None, plan)))


def test_checkpoint_across_expert_layouts(tmp_path):
    """The experts' ShardLayouts are what checkpoints read: saved from TP2 (gate_up as two pieces), loaded
    into EP3 (whole experts, 3-3-2) and into a plain model, every tensor equals the original."""
    from .moe import mixtral as build

    full = {k: v.clone() for k, v in build().state_dict().items()}
    zeros = build()
    with torch.no_grad():
        for p in zeros.parameters():
            p.zero_()

    def save():
        comm = tpkit.get_communicator()
        tpkit.save_sharded(tpkit.parallelize(build(), comm=comm), str(tmp_path), comm=comm)

    def load():
        comm = tpkit.get_communicator()
        import copy
        m = tpkit.parallelize(copy.deepcopy(zeros), plan=EP, comm=comm)
        tpkit.load_sharded(m, str(tmp_path), comm=comm)
        lays = tpkit.shard_layouts(m)
        return all(torch.equal(t, lays[k].shard(full[k])) for k, t in m.state_dict().items())

    tpkit.launch(save, 2, backend="threads")
    assert all(tpkit.launch(load, 3, backend="threads"))
    tpkit.consolidate(str(tmp_path), str(tmp_path / "hf"))
    from safetensors.torch import load_file

    merged = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(merged[k], full[k]) for k in merged) and set(merged) >= {
        "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_transformers_expert_kernels_float32(impl):
    """The experts keep their own forward, so transformers' other kernels (grouped_mm is its default; float32
    only on CPU) run on the shards too, TP and EP, at world size 3 (EP: Mixtral's 8 experts as 3, 3, 2)."""
    import copy

    from .moe import inputs

    ids = inputs()
    base = mixtral(experts=impl)
    ref_model = copy.deepcopy(base)
    out = ref_model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in ref_model.named_parameters()}
    for plan in ("auto", EP):
        copies = [copy.deepcopy(base) for _ in range(3)]

        def body():
            comm = tpkit.get_communicator()
            m = tpkit.parallelize(copies[comm.rank], plan=plan, comm=comm)
            o = m(input_ids=ids, labels=ids)
            o.loss.backward()
            lay = tpkit.shard_layouts(m)
            g_err = max(((p.grad - lay[n].shard(grads[n])).abs().max() / lay[n].shard(grads[n]).abs().max()).item()
                        for n, p in m.named_parameters())
            return ((o.logits - out.logits).abs().max() / out.logits.abs().max()).item(), g_err

        for logit_err, grad_err in tpkit.launch(body, 3, backend="threads"):
            assert logit_err < 1e-5 and grad_err < 1e-4, (plan, logit_err, grad_err)
