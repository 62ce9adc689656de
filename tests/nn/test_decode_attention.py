"""A converted model's attention layers compute a half-precision decode step in float32 on the CPU
(`tpkit.nn.decode_attention`): at least as close to the exact attention as torch's own half-precision kernel, every
other call handed to transformers' "sdpa" function untouched, a stock model in the same process unchanged, and a
converted bf16 Llama decoding transformers' tokens at 1, 2 and 3 ranks: from `parallelize`, `from_pretrained`, meta and
`load_sharded`, and a quantized checkpoint."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpkit
from tpkit.nn import decode_attention
from tpkit.nn.decode_attention import MARK, MAX_COPY_BYTES, decode_sdpa

from .helpers import assert_greedy_up_to_ties

tr = pytest.importorskip("transformers")
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402


class Attention(torch.nn.Module):
    """What transformers' "sdpa" function reads of a module: the query heads per key/value head, causality."""

    def __init__(self, groups: int, marked: bool = True):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True
        if marked:
            self.__dict__[MARK] = True


def _exact(q, k, v, mask):
    """The float64 attention of one query row over every key (GQA by repetition, a bool or additive mask)."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, 1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return (scores.softmax(-1) @ v).transpose(1, 2)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), groups=st.sampled_from([1, 2, 4]),
       dim=st.sampled_from([16, 64, 128]), cached=st.integers(1, 70), dtype=st.sampled_from(["bf16", "fp16"]),
       masked=st.sampled_from(["none", "bool", "additive"]), seed=st.integers(0, 2**16))
def test_a_decode_step_is_at_least_as_close_to_exact_as_torch_s_kernel(batch, kv_heads, groups, dim, cached, dtype,
                                                                        masked, seed):
    decode_attention.install()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * groups, 1, dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, kv_heads, cached, dim, generator=gen).to(dtype) for _ in range(2))
    keep = torch.rand(batch, 1, 1, cached, generator=gen) > 0.3
    keep[..., -1] = True  # (the token itself: every row attends to something)
    mask = {"none": None, "bool": keep,
            "additive": torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(dtype).min).to(dtype)}[masked]
    module = Attention(groups)
    with torch.no_grad():
        ours, weights = decode_sdpa(module, q, k, v, mask, dropout=0.0, scaling=None)
        torch_s, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=None)
    exact = _exact(q, k, v, keep if masked != "none" else None)
    assert ours.dtype == dtype and ours.shape == torch_s.shape == exact.shape and weights is None
    error, torch_error = (float((t.double() - exact).abs().max()) for t in (ours, torch_s))
    assert error <= torch_error + 1e-6, (error, torch_error)


def test_every_other_call_goes_to_the_wrapped_function_with_its_own_tensors(monkeypatch):
    """Unmarked modules, two query rows, a gradient, dropout, float32, keys past `MAX_COPY_BYTES`: transformers'
    function receives the very tensors it was given; a marked decode step receives float32 copies."""
    decode_attention.install()
    seen = []
    monkeypatch.setitem(decode_attention._WRAPPED, "sdpa", lambda m, q, k, v, mask, **kw: (seen.append((q, k, v)),
                                                                                         (q, None))[1])
    h = lambda rows=1, dtype=torch.bfloat16, cached=5: (torch.randn(1, 2, rows, 8).to(dtype),  # noqa: E731
                                                         torch.randn(1, 2, cached, 8).to(dtype),
                                                         torch.randn(1, 2, cached, 8).to(dtype))
    big = MAX_COPY_BYTES // (2 * 8 * 4) + 1
    grad = tuple(t.requires_grad_() for t in h())
    calls = [(Attention(1, marked=False), h(), {}), (Attention(1), h(rows=2), {}), (Attention(1), grad, {}),
             (Attention(1), h(), {"dropout": 0.1}), (Attention(1), h(dtype=torch.float32), {}),
             (Attention(1), h(cached=big), {})]
    for module, (q, k, v), kwargs in calls:
        decode_sdpa(module, q, k, v, None, **kwargs)
        assert all(a is b for a, b in zip(seen[-1], (q, k, v)))
    q, k, v = h()
    with torch.no_grad():
        out, _ = decode_sdpa(Attention(1), q, k, v, None, dropout=0.0)
    assert all(t.dtype == torch.float32 and torch.equal(t, s.float()) for t, s in zip(seen[-1], (q, k, v)))
    assert out.dtype == torch.bfloat16


def _llama(heads: int, kv_heads: int):
    torch.manual_seed(0)
    config = tr.LlamaConfig(vocab_size=320, hidden_size=32 * heads, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32,
                            max_position_embeddings=64)
    return tr.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _counting(monkeypatch) -> list[bool]:
    taken, takes = [], decode_attention.takes
    monkeypatch.setattr(decode_attention, "takes", lambda *a: taken.append(takes(*a)) or taken[-1])
    return taken


@pytest.mark.parametrize("world,heads,kv_heads", [(2, 4, 2), (3, 6, 3)])
def test_a_bf16_llama_decodes_transformers_tokens_with_the_float32_step(world, heads, kv_heads, monkeypatch):
    """Converted at 2 and 3 thread-ranks: every rank's attention layers take the float32 step at decode, every rank
    decodes the same greedy tokens, each the exact (float64) model's choice up to a bf16 tie; transformers' own bf16
    model in this process keeps its logits bit for bit (its modules are not marked)."""
    base = _llama(heads, kv_heads)
    reference = copy.deepcopy(base)
    ids = torch.tensor([[3, 17, 250, 9, 40]])
    with torch.no_grad():
        before = reference(ids).logits
    taken = _counting(monkeypatch)

    def rank(comm):
        model = tpkit.parallelize(copy.deepcopy(base), comm=comm)
        marked = [n for n, m in model.named_modules() if getattr(m, MARK, False)]
        return marked, model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)

    results = tpkit.run_threads(rank, world)
    for marked, tokens in results:
        assert marked == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        assert torch.equal(tokens, results[0][1])
    assert_greedy_up_to_ties(results[0][1], copy.deepcopy(base).double(), ids.shape[1])
    assert taken.count(True) == world * 2 * 5  # every rank, both layers, the 5 steps after the prefill
    with torch.no_grad():
        assert torch.equal(reference(ids).logits, before)


def test_world_1_from_pretrained_deepcopy_and_save_pretrained_keep_transformers_config(tmp_path, monkeypatch):
    """A world-1 load of a bf16 checkpoint takes the float32 step, so does its deep copy (the same tokens, each the exact
    model's choice up to a bf16 tie); `save_pretrained` writes transformers' config (attention "sdpa", nothing of
    tpkit's), which transformers loads back to the same logits."""
    _llama(4, 2).save_pretrained(tmp_path / "in")
    want = tr.AutoModelForCausalLM.from_pretrained(tmp_path / "in", dtype="auto").eval()
    got = tpkit.from_pretrained(str(tmp_path / "in"), progress=False)
    assert got.config._attn_implementation == "sdpa"
    taken = _counting(monkeypatch)
    ids = torch.tensor([[5, 6, 7]])
    tokens = got.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(copy.deepcopy(got).generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), tokens)
    assert_greedy_up_to_ties(tokens, copy.deepcopy(want).double(), ids.shape[1])
    assert taken.count(True) == 2 * 2 * 3
    got.save_pretrained(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert not [k for k in config if "tpkit" in k]
    again = tr.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto").eval()
    assert again.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want(ids).logits)


@pytest.mark.parametrize("world,heads,kv_heads", [(2, 4, 2), (3, 6, 3)])
def test_meta_and_load_sharded_at_2_and_3_ranks_take_the_float32_step(world, heads, kv_heads, tmp_path,
                                                                      monkeypatch):
    """A bf16 Llama built on the meta device, converted at 2 and 3 thread-ranks and filled by `load_sharded` from
    transformers' checkpoint (each rank its slices): every rank's attention layers take the float32 step, and the
    ranks decode the same tokens, each the exact (float64) model's choice up to a bf16 tie."""
    _llama(heads, kv_heads).save_pretrained(tmp_path / "ck")
    want = tr.AutoModelForCausalLM.from_pretrained(tmp_path / "ck", dtype="auto").eval()
    taken = _counting(monkeypatch)
    ids = torch.tensor([[3, 17, 250, 9]])
    with torch.device("meta"):  # built once: `_from_config` sets torch's default dtype, which thread-ranks share
        meta = tr.LlamaForCausalLM._from_config(want.config, dtype=torch.bfloat16)

    def rank(comm):
        model = tpkit.parallelize(copy.deepcopy(meta), comm=comm)
        tpkit.load_sharded(model, str(tmp_path / "ck"), comm=comm, progress=False)
        return model.eval().generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)

    results = tpkit.run_threads(rank, world)
    assert all(torch.equal(tokens, results[0]) for tokens in results)
    assert_greedy_up_to_ties(results[0], copy.deepcopy(want).double(), ids.shape[1])
    assert taken.count(True) == world * 2 * 4  # every rank, both layers, the 4 steps after the prefill


def test_a_quantized_checkpoint_takes_the_float32_step(tmp_path, monkeypatch):
    """A compressed-tensors int4 checkpoint of a bf16 Llama (group 128) loaded by `from_pretrained` at world 1: its
    attention layers take the float32 step, and its tokens are each the choice of transformers' own load of the
    checkpoint (dequantized, in float64) up to a bf16 tie."""
    from tests.quant.checkpoints import compressed_tensors, reference

    directory = compressed_tensors(_llama(4, 2), str(tmp_path / "int4"), "pack-quantized", num_bits=4, type="int",
                                   symmetric=True, strategy="group", group_size=128)
    got = tpkit.from_pretrained(directory, progress=False)
    taken = _counting(monkeypatch)
    ids = torch.tensor([[5, 6, 7, 8]])
    tokens = got.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert taken.count(True) == 2 * 3
    assert_greedy_up_to_ties(tokens, reference(directory).double(), ids.shape[1])
