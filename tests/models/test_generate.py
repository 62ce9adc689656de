"""`model.generate` of a converted HF model gives the unconverted model's tokens: greedy at world sizes 2 and 3,
sampled with the same seed (gloo processes: thread-ranks share one RNG), dynamic and static KV caches, and
transformers' compiled decode (a static cache, the forward compiled by `generate`) against the same compiled decode
of the unconverted model; a float32 model through tpkit's native decode product."""
from __future__ import annotations

import copy

import torch

import tpkit
from tpkit.convert import parallelize

from .hf import hf_model, inputs

def _compiled() -> dict:
    """transformers' compiled decode, asked for on the CPU too (`_compile_all_devices`)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    config._compile_all_devices = True
    return dict(do_sample=False, cache_implementation="static", compile_config=config)


CASES = {
    "greedy": lambda: dict(do_sample=False),
    "greedy_static": lambda: dict(do_sample=False, cache_implementation="static"),
    "sampled": lambda: dict(do_sample=True, top_k=20, temperature=0.9),
    "greedy_compiled": _compiled,
}


def _generate(model, kwargs: dict) -> torch.Tensor:
    torch.manual_seed(5)
    return model.generate(inputs()[:1, :4], max_new_tokens=6, pad_token_id=0, **kwargs)


def _references(pairs) -> dict:
    """{(model name, case): the unconverted model's tokens} (one model per name, as a rank converts one)."""
    models = {n: hf_model(n).eval() for n, _ in pairs}
    return {(n, c): _generate(models[n], CASES[c]()) for n, c in pairs}


def _body(pairs, base=None) -> dict:
    comm = tpkit.get_communicator()
    out, models = {}, {}
    for n, c in pairs:
        if n not in models:
            models[n] = parallelize(copy.deepcopy(base[n]) if base else hf_model(n).eval(), comm=comm)
        out[(n, c)] = _generate(models[n], CASES[c]())
    out["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # the compiled case compiled
    return out


def test_generate_gloo_world_size_2_greedy_static_sampled_compiled():
    pairs = [(n, c) for n in ("llama", "gpt2") for c in ("greedy", "greedy_static", "sampled")]
    pairs.append(("llama", "greedy_compiled"))
    want = _references(pairs)
    for got in tpkit.launch(_body, 2, backend="gloo", args=(pairs,), timeout=240):
        assert got["graphs"] >= 1
        for key, tokens in want.items():
            assert torch.equal(got[key], tokens), (key, got[key].tolist(), tokens.tolist())


def test_generate_threads_world_size_3_greedy_dynamic_and_static():
    pairs = [("llama", "greedy"), ("llama", "greedy_static")]
    want = _references(pairs)
    base = {n: hf_model(n).eval() for n, _ in pairs}
    for got in tpkit.launch(_body, 3, backend="threads", args=(pairs, base)):
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
    want_tokens = _generate(base, CASES["greedy"]())

    def body(comm):
        model = parallelize(copy.deepcopy(base), comm=comm)
        with torch.no_grad():
            return model(ids).logits, _generate(model, CASES["greedy"]())
    for logits, tokens in tpkit.launch(body, 3, backend="threads", pass_comm=True):
        assert float((logits - want).abs().max() / want.abs().max()) < 1e-5
        assert torch.equal(tokens, want_tokens)
    assert len(kinds) >= 3 * (2 * 7 + 1) and set(kinds) == {"fp32"}  # q k v o gate up down x 2 layers, the head
