"""The fused decode products of quantized layers on a GPU (`tpkit.quant.fused`), checked on the CPU.

Each candidate, uncompiled, against float64 of the layer's dequantized weight over drawn shapes and schemes; the
compiled kernels (inductor's C++ here, Triton on a GPU, from the same graph) against their uncompiled selves; the
choice measured against the dequantized product and kept; the policy (`TPKIT_FUSED`); and a layer on a device takes
no CPU product (measuring one there read GPU addresses from the host: a segfault loading int8 onto CUDA). Whole
models of every format at 2 and 3 ranks: `test_checkpoints.py`.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkit.quant import dequantize, fused
from tpkit.quant.compressed_tensors import FORMAT
from tpkit.quant.products import MAX_ROWS
from tpkit.quant.schemes import WeightQuant


def _layer(bits: int, strategy: str, symmetric: bool, out: int, in_: int, group: int, scale_dtype, seed: int):
    """A compressed-tensors `pack-quantized` layer's stored tensors, random."""
    q = WeightQuant("compressed-tensors", "ct_pack", bits, symmetric, strategy,
                    group_size=group if strategy == "group" else None)
    specs = {s.name: s for s in FORMAT.stored_tensors(q, out, in_)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, s in specs.items():
        if name == "weight_shape":
            tensors[name] = torch.tensor([out, in_])
        elif s.dtype == torch.int32:
            tensors[name] = torch.randint(-2 ** 31, 2 ** 31 - 1, s.shape, dtype=torch.int32, generator=g)
        else:
            tensors[name] = (torch.rand(s.shape, generator=g) + 0.5).to(scale_dtype) / 64
    return q, specs, tensors


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([4, 8]), strategy=st.sampled_from(["group", "channel"]), symmetric=st.booleans(),
       out=st.integers(1, 40), words=st.integers(1, 6), group=st.sampled_from([32, 64, 128]),
       rows=st.integers(1, MAX_ROWS), seed=st.integers(0, 99))
def test_each_candidate_is_the_product_by_the_dequantized_weight(bits, strategy, symmetric, out, words, group, rows,
                                                                  seed):
    in_ = words * group
    q, specs, tensors = _layer(bits, strategy, symmetric, out, in_, group, torch.float32, seed)
    x = torch.randn(rows, in_, generator=torch.Generator().manual_seed(seed))
    w = dequantize(q, specs, tensors, {}, (out, in_), torch.float32, FORMAT)
    want = x.double() @ w.double().t()
    assert fused.words_apply(q, (out, in_), torch.float32, torch.float32, False)
    for make in (fused.generic, fused.words):
        got = make(q, specs, (out, in_), torch.float32, FORMAT)(x, tensors, {})
        assert got.shape == (rows, out) and got.dtype == torch.float32
        assert _rel(got, want) < 1e-5, (make.__name__, _rel(got, want))


def test_words_applies_only_where_its_unrounded_weight_is_the_layer_s():
    q = WeightQuant("compressed-tensors", "ct_pack", 4, True, "group", group_size=128)
    assert fused.words_apply(q, (64, 256), torch.bfloat16, torch.bfloat16, False)
    assert not fused.words_apply(q, (64, 256), torch.float32, torch.bfloat16, False)  # bf16-rounded weights
    assert not fused.words_apply(q, (64, 256), torch.bfloat16, torch.bfloat16, True)  # a split cut the groups
    assert not fused.words_apply(q, (64, 200), torch.bfloat16, torch.bfloat16, False)  # not whole groups
    assert not fused.words_apply(WeightQuant("compressed-tensors", "float", 8, True, "channel"), (64, 256),
                                 torch.bfloat16, torch.bfloat16, False)  # nothing packed


def test_the_compiled_kernels_equal_their_uncompiled_products_and_keep_apart_per_shape(monkeypatch):
    monkeypatch.setattr(fused, "_CHOSEN", {})
    monkeypatch.setattr(fused, "_COMPILED", {})
    for name in ("generic", "words"):
        monkeypatch.setattr(fused, "POLICY", name)
        for out in (48, 80):  # two signatures: two compiled functions, each on its own code object
            q, specs, tensors = _layer(4, "group", False, out, 256, 128, torch.bfloat16, out)
            x = torch.randn(1, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
            fn = fused.chosen(x, q, specs, tensors, {}, (out, 256), torch.bfloat16, FORMAT)
            eager = getattr(fused, name)(q, specs, (out, 256), torch.bfloat16, FORMAT)(x, tensors, {})
            assert torch.allclose(fn(x, tensors, {}).float(), eager.float(), rtol=1e-2, atol=1e-2)
            assert fn is fused.chosen(x, q, specs, tensors, {}, (out, 256), torch.bfloat16, FORMAT)
    codes = [k for k, v in fused._CHOSEN.items() if v is not None]
    assert len({id(fused._CHOSEN[k]._torchdynamo_orig_callable.__code__) for k in codes}) == len(codes) == 4
    q, specs, tensors = _layer(4, "group", False, 48, 256, 128, torch.bfloat16, 48)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).bfloat16()  # a batched decode's 3 rows
    fn = fused.chosen(x, q, specs, tensors, {}, (48, 256), torch.bfloat16, FORMAT)
    assert fn is fused._COMPILED[next(k for k in fused._COMPILED if k[0][2] == (48, 256) and k[1] == "words")]
    assert len(fused._COMPILED) == 4  # the same compiled function, its rows made dynamic
    assert _rel(fn(x, tensors, {}), fused.words(q, specs, (48, 256), torch.bfloat16, FORMAT)(x, tensors, {})) < 1e-2


@pytest.mark.parametrize("fastest,expected", [("words", "words"), ("generic", "generic"), ("dequant", None)])
def test_the_choice_is_the_fastest_measured_and_kept(monkeypatch, fastest, expected):
    monkeypatch.setattr(fused, "POLICY", "")
    monkeypatch.setattr(fused, "_CHOSEN", {})
    monkeypatch.setattr(fused, "_COMPILED", {})
    monkeypatch.setattr(fused, "_compiled", lambda fn: fn)  # the choice's logic, not inductor
    measured = []

    def timed(fn, calls=10):
        x = fn()
        way = "dequant" if not hasattr(x, "way") else x.way
        measured.append(way)
        return 1.0 if way == fastest else 2.0

    real = {"generic": fused.generic, "words": fused.words}
    for way, make in real.items():
        def tagged(*a, _make=make, _way=way):
            inner = _make(*a)

            def product(*b):
                y = inner(*b)
                y.way = _way
                return y
            return product
        monkeypatch.setattr(fused, way, tagged)
    monkeypatch.setattr(fused, "_timed", timed)
    q, specs, tensors = _layer(4, "group", True, 16, 128, 128, torch.bfloat16, 0)
    x = torch.randn(1, 128).bfloat16()
    fn = fused.chosen(x, q, specs, tensors, {}, (16, 128), torch.bfloat16, FORMAT)
    assert sorted(set(measured)) == ["dequant", "generic", "words"] and len(measured) == 9  # 3 alternating rounds
    assert (fn is None) if expected is None else fn(x, tensors, {}).way == expected
    fused.chosen(x, q, specs, tensors, {}, (16, 128), torch.bfloat16, FORMAT)
    assert len(measured) == 9  # kept: not measured again


def test_the_policy(monkeypatch):
    x = torch.randn(2, 64)
    monkeypatch.setattr(fused, "POLICY", "")
    assert not fused.wanted(x)  # the CPU has its native product
    for setting, want in (("generic", True), ("words", True), ("0", False)):
        fused.set_policy(setting)
        assert fused.wanted(x) is want
    with pytest.raises(ValueError, match="'fast' is not one of"):
        fused.set_policy("fast")
    fused.set_policy("generic")
    assert not fused.wanted(torch.randn(MAX_ROWS + 1, 64))  # a prefill: the dequantized product's GEMM
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not fused.wanted(torch.randn(1, 64))  # a traced step


def test_a_layer_on_another_device_takes_no_cpu_product(tmp_path):
    import transformers as tr

    import tpkit
    from tests.quant.checkpoints import compressed_tensors
    from tpkit.nn.quantized import quant_method_of

    pytest.importorskip("compressed_tensors")
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(tr.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    path = compressed_tensors(model, str(tmp_path / "int8"), "pack-quantized", num_bits=8, type="int",
                              symmetric=True, strategy="channel")
    loaded = tpkit.from_pretrained(path, progress=False)
    layer = loaded.model.layers[0].mlp.down_proj
    method = quant_method_of(layer)
    assert method.product is not None and len(method.candidates) > 1  # on the CPU: measured among several
    moved = copy.deepcopy(layer).to("meta")
    quant_method_of(moved).after_loading(moved)  # measured them on meta (for CUDA, read its addresses) before
    assert quant_method_of(moved).product is None
    x = torch.randn(1, layer.in_features)
    with torch.no_grad():
        assert _rel(layer(x), F.linear(x, layer.weight)) < 1e-5


def test_a_layer_the_user_compiles_traces_the_fused_product_inline(monkeypatch):
    """Under the user's `torch.compile(fullgraph=True)` the layer's product is "generic" traced into their graph: no
    graph break, no compiled function called inside another, the dequantized product's value."""
    from tpkit.nn.quantized import QuantMethod, QuantizedLinear

    monkeypatch.setattr(fused, "POLICY", "generic")
    monkeypatch.setattr(fused, "_CHOSEN", {})
    monkeypatch.setattr(fused, "_COMPILED", {})
    q, specs, tensors = _layer(4, "group", False, 32, 256, 128, torch.float32, 3)
    layer = QuantizedLinear(256, 32, False, QuantMethod(q, torch.float32), device="cpu", where="probe")
    for name, t in tensors.items():
        layer._buffers[name].copy_(t)
    layer.quant_method.after_loading(layer)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = torch.compile(layer, fullgraph=True)(x)
        want = F.linear(x.double(), layer.weight.double())
    assert _rel(got, want) < 1e-5
    assert fused._CHOSEN == {}  # nothing measured or compiled apart: traced inline
