"""A plan applied without the model's own trace still gets what the families settle for their installs: the whole
model of a cut (plan reuse, the default) and a recorded plan (a tpkit checkpoint's reload, a pipeline stage) once
converted OLMo-2 with its q/k norms over all heads' features left without the gathered norm's sizes, and the first
forward failed ("size of tensor a (48) must match ... (24)"). Against one process in float64, at 2 and 3 ranks:
reuse on, reuse off, and the recorded plan applied again; logits and every gradient."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import tpkit  # noqa: E402

REL = 1e-9
GRAD_REL = 1e-6  # OLMo-2's RMSNorm computes in float32 inside a float64 model: gradients agree to float32's rounding


@pytest.fixture(scope="module")
def olmo2():
    import transformers as tr

    cfg = tr.Olmo2Config(vocab_size=61, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=32)
    torch.manual_seed(0)
    model = tr.Olmo2ForCausalLM(cfg).double().eval()
    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    return model, ids, out.logits.detach(), grads


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("world", [2, 3])
def test_olmo2_gathered_norms_with_reuse_without_it_and_recorded(olmo2, world):
    model, ids, want, grads = olmo2
    copies = {k: [copy.deepcopy(model) for _ in range(world)] for k in ("on", "off", "recorded")}

    def rank(comm):
        out = {}
        first = tpkit.parallelize(copies["on"][comm.rank], comm=comm, reuse=True)
        again = tpkit.parallelize(copies["recorded"][comm.rank], first.tp_plan, comm=comm, recorded=True)
        for name, m in (("on", first), ("off", tpkit.parallelize(copies["off"][comm.rank], comm=comm, reuse=False)),
                        ("recorded", again)):
            res = m(input_ids=ids, labels=ids)
            res.loss.backward()
            layouts = tpkit.shard_layouts(m)
            worst = max(_rel(p.grad, layouts[k].shard(grads[k])) for k, p in m.named_parameters())
            out[name] = (res.logits.detach(), m.tp_plan.to_dict(), worst)
        return out

    results = tpkit.run_threads(rank, world)
    gathered = [k for k, s in results[0]["on"][1]["entries"].items() if s == "gathered_norm"]
    assert gathered, "the plan gathers no norm: the test would not exercise the settled sizes"
    for r in results:
        assert r["on"][1] == r["off"][1] == r["recorded"][1]
        for name, (logits, _, worst) in r.items():
            assert _rel(logits, want) < REL and worst < GRAD_REL, (name, _rel(logits, want), worst)
