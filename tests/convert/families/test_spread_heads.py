"""GQA attention whose KV groups do not divide over the ranks (issue 20 item 9): a Llama with 16 query heads and 4
KV heads splits its query heads as evenly as possible (6/5/5 at 3 ranks), each rank holding the KV heads its
query heads read (a KV head read on two ranks is replicated on both) and expanding them to one per query head
where its groups are unequal. Logits, every gradient, checkpoints across world sizes and cached generation equal
the unconverted model."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import tpkit
from tpkit.layout import head_layout, heads_of
from tests.models.hf import hf_model, inputs

HEADS, KV, HD = 16, 4, 4


def _llama(**over) -> torch.nn.Module:
    return hf_model("llama", num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD, **over).double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _reference():
    model, ids = _llama(), inputs()
    ref_logits = model(input_ids=ids).logits
    _loss(ref_logits, ids).backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return model, ref_logits.detach(), ref_grads


def _rank_errors(model, ref_logits, ref_grads, comm=None):
    """(logits error, worst gradient error, (query heads, KV heads, num_key_value_groups) held) on one rank."""
    ids = inputs()
    m = tpkit.parallelize(model, "auto", comm)
    logits = m(input_ids=ids).logits
    _loss(logits, ids).backward()
    layouts = tpkit.shard_layouts(m)
    worst = max(_rel(p.grad, layouts[n].shard(ref_grads[n])) for n, p in m.named_parameters())
    attn = m.model.layers[0].self_attn
    held = (attn.q_proj.weight.shape[0] // HD, attn.k_proj.weight.shape[0] // HD, attn.num_key_value_groups)
    return _rel(logits, ref_logits), worst, held


def _gloo_body():
    model, ref_logits, ref_grads = _reference()
    return _rank_errors(model, ref_logits, ref_grads)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_logits_and_every_gradient_equal_the_unconverted_model(world):
    model, ref_logits, ref_grads = _reference()
    copies = [copy.deepcopy(model) for _ in range(world)]
    out = tpkit.comm.run_threads(lambda comm: _rank_errors(copies[comm.rank], ref_logits, ref_grads, comm), world)
    _check(out, world)


def test_logits_and_every_gradient_on_gloo_processes():
    _check(tpkit.launch(_gloo_body, 3, backend="gloo", timeout=240), 3)


def _check(out, world):
    assert max(o[0] for o in out) < 1e-9 and max(o[1] for o in out) < 1e-9, out
    lay = head_layout(HEADS, KV, world, spread=True)
    for r, (_, _, (q, kv, groups)) in enumerate(out):
        want_q, want_kv = heads_of(r, world, HEADS, KV, spread=True)
        assert (q, kv) == (len(want_q), len(want_kv))
        assert groups == (q // kv if lay.even_groups(r) else 1)  # unequal groups: KV expanded per query head
    if world == 3:
        assert [o[2][:2] for o in out] == [(6, 2), (5, 2), (5, 2)]  # was 8/4/4 query heads, KV 2/1/1


def test_analyze_states_the_heads_each_rank_holds():
    text = " ".join(tpkit.analyze(_llama(), world_size=3, max_world_size=3, device_memory="1GB").recommendations)
    assert "query heads 6/5/5, KV heads 2/2/2" in text, text
    assert "one head more" not in text


def _save(directory):
    tpkit.save_sharded(tpkit.parallelize(_llama()), directory)


def _load_logits(directory):
    model = tpkit.parallelize(_llama(initializer_range=0.7))
    tpkit.load_sharded(model, directory)
    with torch.no_grad():
        return model(input_ids=inputs()).logits


@pytest.mark.parametrize("saved,loaded", [(3, 2), (2, 3)])
def test_checkpoint_saved_at_one_world_size_loads_at_another(tmp_path, saved, loaded):
    with torch.no_grad():
        ref = _llama()(input_ids=inputs()).logits
    tpkit.launch(_save, saved, backend="threads", args=(str(tmp_path),))
    out = tpkit.launch(_load_logits, loaded, backend="threads", args=(str(tmp_path),))
    assert max(_rel(o, ref) for o in out) < 1e-9


def test_cached_greedy_generation_equals_the_unconverted_model():
    model, prompt = _llama().eval(), inputs()[:1, :4]
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=True)
    ref = model.generate(prompt, **kwargs)
    copies = [copy.deepcopy(model) for _ in range(3)]

    def body(comm):
        return tpkit.parallelize(copies[comm.rank], "auto", comm).generate(prompt, **kwargs)

    for tokens in tpkit.comm.run_threads(body, 3):
        assert torch.equal(tokens, ref)


def test_expanded_kv_heads_compile_fullgraph():
    """The KV expansion hook adds no graph break: compiled forward and backward equal eager at 3 ranks."""
    from tests.nn.test_compile import _threads_body

    torch._dynamo.reset()
    for logit_err, grad_err in tpkit.launch(_threads_body, 3, backend="threads", args=(_llama(),)):
        assert logit_err < 1e-9 and grad_err < 1e-9
