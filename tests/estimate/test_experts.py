"""Expert parallelism in the estimates: the expert bytes a rank holds at ep 1..4 against what a real
`tpkit.expert_parallel` model holds on thread-ranks, the all-to-alls the step prices against the ones a real
dispatch sends, the edp all-reduce and the imbalance factor, the search offering ep for a MoE model and never for a
dense Llama, `estimate_speed` / `tpkit estimate --ep`, analyze's table, a search pick that applies, and bad input
named with its fix. Fake steps and thread-ranks only: no process is launched."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

pytest.importorskip("transformers")

import transformers as tr  # noqa: E402

import tpkit  # noqa: E402
from tpkit.comm.communicator import Communicator  # noqa: E402
from tpkit.estimate import estimate_memory  # noqa: E402
from tpkit.estimate.experts import expert_data_seconds, expert_layers, layer_bytes, valid_eps  # noqa: E402
from tpkit.estimate.predict import Setup, predict, trace_setup  # noqa: E402
from tpkit.estimate.search import candidates, search  # noqa: E402
from tpkit.estimate.speed import estimate_speed  # noqa: E402
from tpkit.experts import experts_of  # noqa: E402

from .test_search import PROFILE, llama  # noqa: E402

H, K, E = 32, 2, 6


def qwen3_moe() -> tr.Qwen3MoeConfig:
    return tr.Qwen3MoeConfig(vocab_size=103, hidden_size=H, intermediate_size=48, moe_intermediate_size=16,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             num_experts=E, num_experts_per_tok=K, decoder_sparse_step=1, mlp_only_layers=[],
                             max_position_embeddings=64)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return tr.Qwen3MoeForCausalLM(qwen3_moe()).float()


def expert_parallel_ranks(model, world: int, tp: int, ep: int, body=None) -> list:
    """Each thread-rank's copy of `model` converted with its experts kept whole and spread over ep, then
    `body(model, comm)` (default: (its parameter bytes, its expert weights' bytes))."""
    copies = [copy.deepcopy(model) for _ in range(world)]

    def run(comm):
        groups = tpkit.comm.groups(comm, tp=tp, ep=ep)
        m = copies[comm.rank]
        if tp > 1:
            m = tpkit.parallelize(m, tpkit.KEEP_EXPERTS_WHOLE if ep > 1 else "auto", groups.tp, mode="training")
        if ep > 1:
            tpkit.expert_parallel(m, groups)
        if body is not None:
            return body(m, comm)
        experts = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if ".experts." in n)
        return sum(p.numel() * p.element_size() for p in m.parameters()), experts
    return tpkit.run_threads(run, world)


@pytest.mark.parametrize("ep", [1, 2, 3, 4])
def test_expert_bytes_per_rank_are_what_expert_parallel_holds(model, ep):
    """ceil(6 / ep) whole experts on the fullest rank (6 over 4: 2, 2, 1, 1): the estimate's parameters and expert
    parameters per rank equal a real expert-parallel model's on thread-ranks, from the model or its config, traced
    (training) or counted (inference); analyze's table says the same."""
    real = expert_parallel_ranks(model, ep, 1, ep)
    whole = sum(p.numel() * 4 for p in model.parameters())
    dp = {"dp_size": ep, "dp_mode": "ddp"} if ep > 1 else {}
    for subject in (model, qwen3_moe()):
        for mode in ("inference", "training"):
            est = estimate_memory(subject, 1, dtype=torch.float32, mode=mode, seq_len=16, ep=ep, **dp)
            assert est.per_rank.parameters == max(total for total, _ in real)
            assert est.expert_parameters_per_rank * 4 == real[0][1] == max(e for _, e in real)
            assert est.ep == ep and est.single.parameters == whole
    report = tpkit.analyze(model, world_size=1, max_world_size=1, device_memory="1MB", calibrate=False)
    rows = {r[0]: r for r in report.experts.rows}
    if ep in rows:
        assert report.experts.rest + rows[ep][3] == max(total for total, _ in real)
        assert rows[ep][1] == math.ceil(E / ep)


def test_tp_inside_the_expert_group():
    """tp2 x dp2 with ep4: each TP rank keeps 2 or 1 whole experts of a layer, TP leaving them whole; the estimate
    at world size 2, dp_size 2 holds what the fullest real rank holds, FSDP2 leaving the experts unsharded."""
    torch.manual_seed(0)
    moe = tr.Qwen3MoeForCausalLM(qwen3_moe()).float()
    real = expert_parallel_ranks(moe, 4, 2, 4)
    for mode in ("inference", "training"):
        est = estimate_memory(qwen3_moe(), 2, dtype=torch.float32, mode=mode, seq_len=16, ep=4, dp_size=2,
                              dp_mode="ddp")
        assert est.per_rank.parameters == max(total for total, _ in real)
        assert est.expert_parameters_per_rank * 4 == real[0][1]
    fsdp = estimate_memory(qwen3_moe(), 2, dtype=torch.float32, mode="training", seq_len=16, ep=4, dp_size=2,
                           dp_mode="fsdp")
    experts = fsdp.expert_parameters_per_rank * 4
    assert experts == real[0][1]
    assert fsdp.per_rank.parameters - experts == pytest.approx((est.per_rank.parameters - experts) / 2, rel=0.05)


def test_the_priced_all_to_alls_are_the_dispatch_s_own(model):
    """A real training step at ep3 over dp3 (thread-ranks, Communicator.all_to_all wrapped): per MoE layer three
    all-to-alls forward (counts, pairs out, results back) and two backward; the pairs each rank sends are its own
    n x k rows of H (every routing), the results come back as many as were sent in all. The traced step prices
    the same buffers (uniform routing: each rank receives as many as it sends), at the machine's all-to-all."""
    ep, batch, seq = 3, 2, 12  # 24 tokens a rank, 48 pairs: 6 experts over 3 ranks, 2 each, divide them evenly
    calls: list[tuple[int, int, list[int]]] = []
    original = Communicator.all_to_all

    def recorded(self, tensor, scatter_dim, gather_dim, scatter_sizes=None, gather_sizes=None, async_op=False):
        calls.append((self.rank, tensor.numel() * tensor.element_size(), list(scatter_sizes or [])))
        return original(self, tensor, scatter_dim, gather_dim, scatter_sizes, gather_sizes, async_op)

    def step(m, comm):
        ids = torch.randint(3, 103, (batch, seq), generator=torch.Generator().manual_seed(comm.rank))
        m(input_ids=ids, labels=ids).loss.backward()
        return None
    Communicator.all_to_all = recorded
    try:
        expert_parallel_ranks(model, ep, 1, ep, step)
    finally:
        Communicator.all_to_all = original
    fwd, bwd = layer_bytes(batch * seq, K, H, 4, E, ep)
    assert fwd == (E * 8, batch * seq * K * H * 4, batch * seq * K * H * 4) and bwd == fwd[1:]
    per_rank = [[(n, s) for q, n, s in calls if q == r] for r in range(ep)]
    assert all(len(c) == 2 * (3 + 2) for c in per_rank)  # 2 MoE layers: counts, out, back; backward: out, back
    for c in per_rank:  # forward layer 1, layer 2; backward layer 2, layer 1
        assert [c[i][0] for i in (0, 3)] == [E * 8] * 2 and [c[i][0] for i in (1, 4, 6, 8)] == [fwd[1]] * 4
    assert sum(c[2][0] for c in per_rank) == ep * fwd[2]  # every pair comes back: uniform on average
    leaving = [sum(s[j] for j in range(ep) if j != r) * H * 4 for r, c in enumerate(per_rank) for _, s in (c[1], c[4])]
    assert sum(leaving) / len(leaving) == pytest.approx(fwd[1] * (ep - 1) / ep, rel=0.3)  # random routing
    traced = trace_setup(qwen3_moe(), Setup(1, ep, "ddp", ep=ep), "train", batch * ep, seq, dtype=torch.float32)
    (_, t), = traced.rows
    priced = [c.nbytes for c in t.collectives if c.group == "ep"]
    assert priced == [*fwd, *fwd, *bwd, *bwd]
    assert fwd[2] == fwd[1]  # uniform: as many back as out
    rates = PROFILE.rates(ep)
    p = predict(qwen3_moe(), Setup(1, ep, "ddp", ep=ep), "train", batch * ep, seq, PROFILE, traced=traced)
    assert p.ep_communication_s == pytest.approx(sum(rates.collective("all_to_all", ep).seconds(n)
                                                     + rates.train_collective_overhead_s for n in priced), rel=1e-9)


def test_the_edp_all_reduce_the_imbalance_and_what_ddp_leaves(model):
    """ep2 over dp4: every expert tensor's gradient is all-reduced over the 2 ranks holding the same experts, DDP
    buckets the rest; an imbalance of 1.5 makes the fullest rank receive and compute more."""
    cfg, batch, seq = qwen3_moe(), 4, 12
    one, two = (predict(cfg, Setup(1, 4, "ddp", ep=2, ep_imbalance=f), "train", batch, seq, PROFILE,
                        dtype=torch.float32, ranks=3) for f in (1.0, 1.5))
    (_, t), = trace_setup(cfg, Setup(1, 4, "ddp", ep=2), "train", batch, seq, dtype=torch.float32).rows
    rates = PROFILE.rates(3)
    reduce = expert_data_seconds([math.prod(s) * 4 for s in t.expert_shapes], rates, 2,
                                 rates.train_collective_overhead_s)
    a2a = sum(rates.collective("all_to_all", 2).seconds(c.nbytes) + rates.train_collective_overhead_s
              for c in t.collectives if c.group == "ep")
    assert len(t.expert_shapes) == 4 and reduce > 0 and one.ep_communication_s == pytest.approx(a2a + reduce)
    assert one.expert_bytes == sum(math.prod(s) for s in t.expert_shapes) * 4 == 2 * 3 * 3 * H * 16 * 4
    assert two.ep_communication_s > one.ep_communication_s and two.flops > one.flops
    plain = predict(cfg, Setup(1, 4, "ddp"), "train", batch, seq, PROFILE, dtype=torch.float32, ranks=3)
    assert one.dp_communication_s < plain.dp_communication_s  # the experts are not in DDP's buckets
    with pytest.raises(ValueError, match="ep_imbalance must be a number >= 1.0"):
        Setup(1, 2, "ddp", ep=2, ep_imbalance=0.5)


def test_search_offers_ep_for_the_moe_model_and_none_for_a_dense_llama(model):
    moe = {s.label() for s in candidates(model, 4, "train", experts=E)}
    assert {"tp1, ep2, dp4 ddp", "tp1, ep4, dp4 fsdp", "tp2, ep2, dp2 ddp", "tp2, ep4, dp2 fsdp", "tp4, ep4"} <= moe
    assert not any("ep3" in label for label in moe)  # 3 does not divide 4 devices
    assert valid_eps(2, 12, 6) == [2, 4, 6] and valid_eps(1, 4, 3) == [2]
    assert "tp1, ep2, dp2 replicas" in {s.label() for s in candidates(model, 2, "decode", experts=E)}
    found = search(qwen3_moe(), 2, "train", batch_size=2, seq_len=16, profile=PROFILE, dtype=torch.float32,
                   alternatives=False, context=False)
    with_ep = {c.setup.label() for c in found.candidates if c.ep > 1}
    assert with_ep == {"tp1, ep2, dp2 ddp", "tp1, ep2, dp2 fsdp", "tp2, ep2"}
    assert any(n.startswith("expert parallelism:") for n in found.notes)
    dense = search(llama(2), 2, "train", batch_size=2, seq_len=16, profile=PROFILE, dtype=torch.float32,
                   alternatives=False, context=False)
    assert all(c.ep == 1 for c in dense.candidates) and not any("expert" in n for n in dense.notes)
    assert isinstance(expert_layers(tr.LlamaForCausalLM(llama(2))), str)
    with pytest.raises(ValueError, match="no fused experts module.*use ep=1"):
        predict(llama(2), Setup(1, 2, "ddp", ep=2), "train", 2, 16, PROFILE)


def test_an_ep_pick_applies_and_gives_one_process_s_loss(model):
    """tp2 = ep2 through `apply_setup` (experts kept whole by the plan, spread by expert_parallel): the loss one
    process gives, on thread-ranks."""
    ids = torch.randint(3, 103, (1, 12), generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(model)(input_ids=ids, labels=ids).loss.item()
    copies = [copy.deepcopy(model) for _ in range(2)]

    def body(comm):
        m = tpkit.apply_setup(copies[comm.rank], Setup(2, ep=2), comm)
        assert experts_of(m) is not None
        return m(input_ids=ids, labels=ids).loss.item()
    assert max(abs(x - ref) for x in tpkit.run_threads(body, 2)) < 1e-5


def test_bad_ep_input_names_the_fix(model):
    cfg = qwen3_moe()
    with pytest.raises(ValueError, match=r"ep 3 does not divide .* = 2 ranks.*choose ep among \[1, 2\].*dp_size=3"):
        estimate_memory(cfg, 1, mode="training", ep=3, dp_size=2, dp_mode="ddp")
    with pytest.raises(ValueError, match="ep 8 exceeds the 6 experts.*choose ep <= 6"):
        estimate_memory(cfg, 1, ep=8, dp_size=8, dp_mode="ddp")
    with pytest.raises(ValueError, match="ep 3 is not a multiple of tp 2"):
        Setup(2, 3, "ddp", ep=3)
    with pytest.raises(ValueError, match="ep must be a positive int"):
        estimate_memory(cfg, 1, ep=0)
    with pytest.raises(ValueError, match="LlamaConfig|no fused experts module"):
        estimate_memory(llama(2), 1, ep=2, dp_size=2, dp_mode="ddp")
    with pytest.raises(ValueError, match="ep 4 is not a multiple of any world size"):
        estimate_speed(cfg, [8], hardware="H100-SXM", ep=4, seq_len=16)


def test_estimate_speed_and_the_command_price_ep(capsys, tmp_path):
    cfg = qwen3_moe()
    speed = estimate_speed(cfg, [1, 2, 8], hardware="H100-SXM", mode="training", seq_len=16, ep=2)
    assert [r.world_size for r in speed.rows] == [1, 2] and speed.ep == 2
    assert any("world sizes 8 left out" in n for n in speed.notes)
    assert any("TP 1 on 2 devices (2 replicas)" in n for n in speed.notes)
    from tpkit.cli import main

    cfg.save_pretrained(tmp_path)
    argv = ["estimate", str(tmp_path / "config.json"), "--world-size", "1,2", "--mode", "training", "--seq-len", "16",
            "--ep", "2", "--hardware", "H100-SXM"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["ep"] for m in out["memory"]] == [2, 2] and out["speed"]["ep"] == 2
    ref = estimate_memory(cfg, 1, mode="training", seq_len=16, ep=2, dp_size=2, dp_mode="ddp")
    assert out["memory"][0]["per_rank"] == ref.per_rank.to_dict()
    assert out["memory"][0]["expert_parameters_per_rank"] == 3 * 2 * 3 * H * 16
    assert main(["estimate", "llama-3-8b", "--ep", "2", "--hardware", "H100-SXM"]) == 2
    assert "no fused experts module" in capsys.readouterr().err
