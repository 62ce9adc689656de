"""Prices per dtype (issue 56 item 4): a dense bf16 / fp16 / float32 model is priced by the products it runs, not by
float32's tables. At decode's rows a converted layer runs tpkit's own product (`tpkit.quant.products.dense_linear`),
priced as calibrated ("dense/bfloat16", "dense/float32"); elsewhere its matmuls run BLAS in its dtype, priced at
that dtype's measured rates (`MachineRates.dtype_gemm`)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import tpkit
from tpkit.estimate.machine import MachineRates, QuantizedRate
from tpkit.estimate.ops import DENSE
from tpkit.estimate.predict import Setup, kernel_times, trace_setup
from tpkit.estimate.quantized import quantized_times
from tests.conftest import synthetic_profile

tr = pytest.importorskip("transformers")

HALF = {"dense/bfloat16": QuantizedRate("native bf16", 7e-6, ((1, 9e9), (8, 3e9)))}


def _config():
    """A Llama of hidden 512 (4 heads of 128, 2 KV heads), MLP 1536, 2 layers, vocabulary 512 (traced at the dtype
    each test asks for)."""
    return tr.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _rates(world: int, **changes) -> MachineRates:
    return dataclasses.replace(synthetic_profile().rates(world), **changes)


def _dense(trace):
    return [o for o in trace.ops if o.quantized is not None and o.quantized.kind == DENSE]


def _trace(world, goal="decode", batch=1, dtype=torch.bfloat16, seq=16):
    return trace_setup(_config(), Setup(world), goal, batch, seq, dtype=dtype).rows[0][1]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_converted_bf16_layer_at_decode_is_priced_as_the_product_it_runs(world):
    """Each linear layer of the rank (q k v o gate up down x 2 layers, and the LM head; split, or whole at world 1,
    `DecodeLinear`) is one op priced
    as the calibrated product: its fixed cost + its weight's bytes at the rate of its rows, log-linear between 1
    and 8 rows; with no such entry in the profile (measured before it, or a datasheet) it is priced as any matmul."""
    rates = _rates(world, quantized=HALF)
    table = QuantizedRate("", 0.0, ((1, 9e9), (8, 3e9)))
    for batch in (1, 3, 8):
        dense = _dense(_trace(world, batch=batch))
        assert len(dense) == 2 * 7 + 1 and {o.quantized.key for o in dense} == {"dense/bfloat16"}
        for op in dense:
            m, n, k = op.mnk
            assert m == batch and op.quantized.stored_bytes == n * k * 2 and op.dtype == "bfloat16"
            assert quantized_times(op, rates) == (0.0, pytest.approx(7e-6 + n * k * 2 / table.bandwidth(m), rel=1e-12))
    assert 3e9 < table.bandwidth(3) < 9e9
    plain = _rates(world)  # no calibrated entry: as any matmul, exactly as without the record
    trace = _trace(world)
    unmarked = dataclasses.replace(trace, ops=tuple(dataclasses.replace(o, quantized=None) for o in trace.ops))
    assert kernel_times(trace, plain) == kernel_times(unmarked, plain)
    assert sum(kernel_times(trace, rates)) != sum(kernel_times(unmarked, rates))


def test_only_the_rows_and_steps_where_the_product_runs_are_priced_as_it():
    """More than 8 rows, or a training step (its input needs a gradient), at one rank as at two: ordinary matmuls,
    none priced as the decode product. fp16 and float32 weights at decode are priced as their own product's
    entry."""
    for world in (1, 2):
        assert _dense(_trace(world, batch=9)) == []
        assert _dense(_trace(world, goal="train", batch=1, seq=4)) == []  # 4 rows: excluded by the gradient alone
        assert _dense(_trace(world, goal="prefill", batch=1, seq=4))  # the same rows, no gradient: the product
    assert _dense(_trace(2, dtype=torch.float32, batch=9)) == []
    for dtype in (torch.float16, torch.float32):
        dense = _dense(_trace(2, dtype=dtype))
        assert len(dense) == 2 * 7 + 1 and {o.quantized.key for o in dense} == {f"dense/{str(dtype)[6:]}"}


@pytest.mark.parametrize("world,dtype", [(1, torch.bfloat16), (2, torch.bfloat16), (3, torch.bfloat16),
                                         (3, torch.float32)])
def test_the_priced_layers_are_the_ones_whose_forward_runs_tpkits_product(world, dtype, monkeypatch):
    """Against the runtime: a bf16 (float32) model converted on thread-ranks decodes one token; the weight shapes that
    reach `dense_linear` on rank 0 are, call for call, the shapes of the ops the estimate prices as that product (at
    world 1 every layer whole: each a `DecodeLinear`)."""
    import threading

    import tpkit.quant.products as products

    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(_config()).eval().to(dtype)
    calls: dict[int, list[tuple[int, int]]] = {}  # rank -> weight shapes, of the one decoded token
    rank_of: dict[int, int] = {}  # thread -> rank
    real = products.dense_linear

    def seen(x, weight):
        if threading.get_ident() in rank_of:  # a rank's forward (not the estimate's trace below, in this thread)
            calls.setdefault(rank_of[threading.get_ident()], []).append(tuple(weight.shape))
        return real(x, weight)

    def run(comm):
        rank_of[threading.get_ident()] = comm.rank
        m = tpkit.parallelize(copy.deepcopy(model), comm=comm)
        with torch.inference_mode():
            cache = m(input_ids=torch.tensor([[1, 2, 3, 4]]), use_cache=True).past_key_values
            comm.barrier()
            calls.pop(comm.rank, None)
            m(input_ids=torch.tensor([[5]]), past_key_values=cache, use_cache=True)
    monkeypatch.setattr(products, "dense_linear", seen)  # (`products.faster_linear`: every linear layer's product)
    tpkit.run_threads(run, world)
    priced = [(n, k) for _, n, k in (o.mnk for o in _dense(_trace(world, dtype=dtype)))]
    assert sorted(calls[0]) == sorted(priced) and len(priced) == 2 * 7 + 1, (calls[0], priced)


def test_matmuls_are_priced_at_their_dtypes_measured_rates():
    """A bf16 training step's matmuls at the bf16 table (here 4x float32's), a float32 step's at float32's; a
    profile without the table prices every dtype at float32's; the table survives the profile's JSON."""
    base = _rates(2)
    fast = dataclasses.replace(base, dtype_gemm={"bfloat16": tuple(
        (w, tuple((m, 4 * f) for m, f in t)) for w, t in (base.linear_gemm or ((1024, base.gemm),)))})
    assert fast.flops_rate(64, 1024, False, "bfloat16") == pytest.approx(4 * base.flops_rate(64, 1024, False))
    assert fast.flops_rate(64, 1024, False, "float16") == base.flops_rate(64, 1024, False)
    trace = _trace(2, goal="train", batch=4)
    compute_bf16 = kernel_times(trace, fast)[0]
    compute_plain = kernel_times(trace, base)[0]
    assert 0 < compute_bf16 < compute_plain
    single = _trace(2, goal="train", batch=4, dtype=torch.float32)  # float32 matmuls keep float32's rates
    assert kernel_times(single, fast) == kernel_times(single, base)
    assert MachineRates.from_dict(fast.to_dict()) == fast
    half = dataclasses.replace(base, quantized=HALF)
    assert MachineRates.from_dict(half.to_dict()) == half


@pytest.mark.parametrize("tp", [1, 2])
def test_a_bf16_model_decodes_with_the_framework_terms_measured_in_bf16(tp):
    """The framework's own time per token is measured per dtype for decoding (a bf16 model's norms, rotary embedding
    and logits convert where a float32 one's do not): a bf16 model takes the bf16 terms, a float32 one float32's,
    and a profile measured before (no bf16 terms) prices both by float32's."""
    from tpkit.estimate.framework import FrameworkCost
    from tpkit.estimate.machine import framework_key
    from tpkit.estimate.predict import predict

    cfg, prof = _config(), synthetic_profile()
    terms = {framework_key("llama", "decode"): FrameworkCost(1e-3, 0.5e-3),
             framework_key("llama", "decode", "bfloat16"): FrameworkCost(2e-3, 1.25e-3)}
    measured = dataclasses.replace(prof, machine={k: dataclasses.replace(r, framework=terms, tp_framework=terms)
                                                  for k, r in prof.machine.items()})
    old = dataclasses.replace(prof, machine={
        k: dataclasses.replace(r, framework={"llama/decode": terms["llama/decode"]},
                               tp_framework={"llama/decode": terms["llama/decode"]}) for k, r in prof.machine.items()})
    got = {(p, dtype): predict(cfg, Setup(tp), "decode", 1, 16, profile, dtype=dtype).overhead_s
           for p, profile in (("measured", measured), ("old", old)) for dtype in (torch.float32, torch.bfloat16)}
    layers = cfg.num_hidden_layers
    assert got["measured", torch.bfloat16] - got["measured", torch.float32] == pytest.approx(1e-3 + layers * 0.75e-3)
    assert got["old", torch.bfloat16] == pytest.approx(got["old", torch.float32])
    assert got["old", torch.float32] == pytest.approx(got["measured", torch.float32])


def test_the_calibration_measures_decodings_terms_in_each_dtype_on_a_model_of_that_dtype(monkeypatch):
    """`framework_costs` runs decoding's tiny models in each dtype asked for, under each dtype's key, and training's in
    float32 (a real run, two repeats: the terms' values are the machine's; their keys and models are checked)."""
    from tpkit.estimate import framework

    built = []
    original = framework.tiny_model

    def spy(family, layers, vocab=framework.FRAMEWORK_LOGITS, dtype=torch.float32):
        model = original(family, layers, vocab, dtype)
        built.append((dtype, next(model.parameters()).dtype))
        return model
    monkeypatch.setattr(framework, "tiny_model", spy)
    terms = framework.framework_costs(_rates(1), None, ("llama",), repeats=2)
    assert set(terms) == {"llama/decode", "llama/decode/bfloat16", "llama/train"}
    assert all(asked == made for asked, made in built)
    assert {d for d, _ in built} == {torch.float32, torch.bfloat16}
    assert all(t.step_s >= 0 and t.layer_s >= 0 for t in terms.values())
