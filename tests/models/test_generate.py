"""`model.generate` of a converted HF model gives the unconverted model's tokens: greedy at world sizes 2 and 3,
sampled with the same seed (gloo processes: thread-ranks share one RNG), dynamic and static KV caches; a float32
model through tpkit's native decode product."""
from __future__ import annotations

import copy

import torch

import tpkit
from tpkit.convert import parallelize

from .hf import hf_model, inputs

CASES = {
    "greedy": dict(do_sample=False),
    "greedy_static": dict(do_sample=False, cache_implementation="static"),
    "sampled": dict(do_sample=True, top_k=20, temperature=0.9),
}


def _generate(model, kwargs: dict) -> torch.Tensor:
    torch.manual_seed(5)
    return model.generate(inputs()[:1, :4], max_new_tokens=6, pad_token_id=0, **kwargs)


def _references(names, cases) -> dict:
    return {(n, c): _generate(hf_model(n).eval(), CASES[c]) for n in names for c in cases}


def _body(names, cases, base=None) -> dict:
    comm = tpkit.get_communicator()
    out = {}
    for n in names:
        model = parallelize(copy.deepcopy(base[n]) if base else hf_model(n).eval(), comm=comm)
        for c in cases:
            out[(n, c)] = _generate(model, CASES[c])
    return out


def test_generate_gloo_world_size_2_greedy_static_sampled():
    names, cases = ("llama", "gpt2"), ("greedy", "greedy_static", "sampled")
    want = _references(names, cases)
    for got in tpkit.launch(_body, 2, backend="gloo", args=(names, cases), timeout=240):
        for key, tokens in want.items():
            assert torch.equal(got[key], tokens), (key, got[key].tolist(), tokens.tolist())


def test_generate_threads_world_size_3_greedy_dynamic_and_static():
    names, cases = ("llama",), ("greedy", "greedy_static")
    want = _references(names, cases)
    base = {n: hf_model(n).eval() for n in names}
    for got in tpkit.launch(_body, 3, backend="threads", args=(names, cases, base)):
        for key, tokens in want.items():
            assert torch.equal(got[key], tokens), (key, got[key].tolist(), tokens.tolist())


def test_a_float32_model_at_decode_through_tpkits_product_gives_transformers_logits_and_tokens(forced_native):
    """float32 weights at decode's rows take tpkit's native product where it was measured faster (forced here, on 3
    thread-ranks): the converted model's logits equal one process of plain transformers to float32 rounding, and
    greedy tokens are the same; the product ran for every parallel layer of every rank."""
    kinds = forced_native
    base = hf_model("llama").eval()
    ids = inputs()[:1, :4]
    with torch.no_grad():
        want = base(ids).logits
    want_tokens = _generate(base, CASES["greedy"])

    def body(comm):
        model = parallelize(copy.deepcopy(base), comm=comm)
        with torch.no_grad():
            return model(ids).logits, _generate(model, CASES["greedy"])
    for logits, tokens in tpkit.launch(body, 3, backend="threads", pass_comm=True):
        assert float((logits - want).abs().max() / want.abs().max()) < 1e-5
        assert torch.equal(tokens, want_tokens)
    assert len(kinds) >= 3 * (2 * 7 + 1) and set(kinds) == {"fp32"}  # q k v o gate up down x 2 layers, the head
