"""tpkit's compiled small-batch product (`tpkit.quant.native`, `gemv.c`) against the plain torch product of the
decoded weight: every weight kind, block scales and zero points, one and several rows, odd shapes (tails past the
vector width), inputs of every floating dtype; and its use by dense bf16 / fp16 / float32 layers
(`products.dense_linear`).
Its scales and zero points read in place: `test_native_inplace.py`."""
from __future__ import annotations

import os

import pytest
import torch

from tpkit.quant import native
from tpkit.quant.products import dense_linear

from .test_native_int16 import int_runs, runs_of

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler built tpkit's native product here")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _blocks(t: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    return t.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


@pytest.mark.parametrize("n,k", [(64, 256), (37, 320), (5, 96), (9, 100), (3, 330)])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_each_kind_equals_the_product_of_its_decoded_weight(n, k, rows, build):
    """On every instruction-set path, inputs whose width leaves tails past the vector width (k 100, 330: every kind's
    scalar tail, fp16's among them, which once lost its scale on the AVX-512 path)."""
    g = torch.Generator().manual_seed(n * k + rows)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    block = (4, 32 if k % 32 == 0 else 10)
    nb, kb = -(-n // block[0]), -(-k // block[1])
    s = torch.rand(nb, kb, generator=g) + 0.1
    z = torch.randint(-8, 8, (nb, kb), dtype=torch.int8, generator=g)
    cases = {"bf16": (w.bfloat16(), w.bfloat16().float(), None, None),
             "fp16": (w.half(), w.half().float(), None, None)}
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    cases["int8"] = (q8, (q8.float() - _blocks(z, block, (n, k))) * _blocks(s, block, (n, k)), s, z)
    u8 = q8.view(torch.uint8)
    cases["uint8"] = (u8, (u8.float() - _blocks(z, block, (n, k))) * _blocks(s, block, (n, k)), s, z)
    u4 = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    cases["uint4"] = ((u4[:, 0::2] | (u4[:, 1::2] << 4)).contiguous(),
                      (u4.float() - _blocks(z, block, (n, k))) * _blocks(s, block, (n, k)), s, z)
    f8 = (w * 64).to(torch.float8_e4m3fn)  # normal and subnormal FP8 values
    f8[0, :8] = torch.tensor([0.0, -0.0, 2 ** -9, -(2 ** -7), 448.0, -448.0, 0.001953125, 1.0]).to(f8.dtype)
    cases["fp8"] = (f8, f8.float() * _blocks(s, block, (n, k)), s, None)
    cases["fp32"] = (w, w, None, None)  # a float32 model's dense weight
    for kind, (stored, dense, scale, zero) in cases.items():
        got = native.gemv(x, stored, kind, n, scale, zero, block if scale is not None else (1, 1))
        assert _rel(got, x @ dense.t()) < 1e-5, kind


@pytest.mark.parametrize("scale", [1e-7, 1e-3, 1.0, 1e20])
def test_fp8_and_fp16_weights_keep_their_precision_at_any_activation_size(scale, build):
    """FP8 (and, without AVX-512, fp16) weights are multiplied as floats scaled far down (2^-120, 2^-112): x is scaled
    up first, so small activations times small weights stay normal floats (unscaled, activations of 1e-7 lost most
    of their bits and 1e-3 ran 15x slower, in microcode); activations past 2^62 are left unscaled."""
    g = torch.Generator().manual_seed(7)
    n, k = 48, 640
    w = torch.randn(n, k, generator=g)
    x = torch.randn(3, k, generator=g) * scale
    for kind, stored in (("fp8", (w * 100).clamp(-448, 448).to(torch.float8_e4m3fn)), ("fp16", w.half())):
        got = native.gemv(x, stored, kind, n)
        assert _rel(got, x.double() @ stored.double().t()) < 1e-6, (kind, scale)


@pytest.mark.parametrize("n,k,block", [(64, 256, (1, 128)), (37, 384, (4, 128)), (5, 1024, (2, 256)),
                                         (16, 512, (1, 512)), (9, 320, (1, 64)), (7, 200, (1, 100))])
@pytest.mark.parametrize("rows", [1, 5])
def test_bf16_inputs_equal_the_float64_product(n, k, block, rows, build):
    """bf16 activations (a bf16 model's) take AVX512-BF16's dot products for bf16 weights where the CPU has them,
    and for int4 weights where it has no VNNI (int4 where its blocks are whole runs of 128 values; 64 and 100 wide
    blocks, and k 200, keep the float32 loops), the VNNI runs or, in AVX2 builds, the int16 runs of x for int4
    weights (test_native_int16.py): the float32 sums before the output's
    rounding to bf16 equal the float64 product of the same values (x as its runs stand for it, where taken), zero
    points and scales of each dtype included, on every instruction-set path."""
    g = torch.Generator().manual_seed(n * k + rows)
    x = torch.randn(rows, k, generator=g).bfloat16()
    unit, bits = runs_of(k, block[1], "uint4")  # AVX2 builds, VNNI without BF16: x's integer runs (test_native_int16)
    runs = int_runs(x, unit, bits)[0] if unit else x.double()
    nb, kb = -(-n // block[0]), -(-k // block[1])
    u4 = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    stored = (u4[:, 0::2] | (u4[:, 1::2] << 4)).contiguous()
    for scale_dtype in (torch.float32, torch.bfloat16, torch.float16):
        s = (torch.rand(nb, kb, generator=g) + 0.1).to(scale_dtype)
        for zero in (None, torch.randint(-8, 8, (nb, kb), dtype=torch.int8, generator=g)):
            z = 0 if zero is None else _blocks(zero, block, (n, k)).double()
            dense = (u4.double() - z - 8) * _blocks(s.double(), block, (n, k))
            got = native._run(x.float(), stored, native.KINDS["uint4"], s, zero, *block, n, 8.0, 0, True)
            assert _rel(got, runs @ dense.t()) < 1e-6, (scale_dtype, zero is None)
    w = torch.randn(n, k, generator=g).bfloat16()
    got = native._run(x.float(), w, native.KINDS["bf16"], None, None, 1, 1, n, 0.0, 0, True)
    assert _rel(got, x.double() @ w.double().t()) < 1e-6
    assert _rel(native.gemv(x, stored, "uint4", n, s, zero, block, 8).double(), x.double() @ dense.t()) < 1e-2


@pytest.mark.parametrize("x_scale", [1e-7, 1.0, 1e20])
@pytest.mark.parametrize("n,k,block", [(48, 640, (1, 640)), (9, 200, (1, 200)), (16, 512, (4, 128)), (5, 300, (1, 100))])
def test_fp8_weights_with_bf16_inputs_equal_the_float64_product_subnormals_included(n, k, block, x_scale, build):
    """One row of bf16 activations (a decode step's) takes the bf16 dot products for FP8 weights too, which read a
    bf16 denormal (an FP8 subnormal) as 0: those products are added apart. A checkpoint scaled to FP8's range (few
    subnormals), the same with one subnormal per row first met mid-row (after runs without one, the rest of the block
    takes their product), one of unscaled normal values (1% subnormal), and subnormals in every run and in the tail
    past the last 64 values, at activations from 1e-7 to 1e20, per channel and per block scales, on every
    instruction-set path."""
    g = torch.Generator().manual_seed(n * k)
    x = (torch.randn(1, k, generator=g) * x_scale).bfloat16()
    w = torch.randn(n, k, generator=g)
    subnormals = torch.tensor([2.0 ** -9, -(2.0 ** -8), 3 * 2.0 ** -9, -(7 * 2.0 ** -9)])
    dense = w.clone()
    dense[:, 5::61] = subnormals[torch.arange(dense[:, 5::61].numel()) % 4].view(n, -1)
    dense[:, -1] = subnormals[torch.arange(n) % 4]  # in the tail past the last whole 64 (k 200, 300)
    nb, kb = -(-n // block[0]), -(-k // block[1])
    s = (torch.rand(nb, kb, generator=g) + 0.1).bfloat16()
    scaled = w / w.abs().amax(1, keepdim=True) * 448
    late = scaled.clone()
    late[:, k // 2] = subnormals[torch.arange(n) % 4]  # first met mid-row, after runs without one
    for stored in (scaled.to(torch.float8_e4m3fn), late.to(torch.float8_e4m3fn), dense.to(torch.float8_e4m3fn)):
        want = x.double() @ (stored.double() * _blocks(s.double(), block, (n, k))).t()
        got = native._run(x.float(), stored, native.KINDS["fp8"], s, None, *block, n, 0.0, 0, True)
        assert _rel(got, want) < 1e-6, x_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_inputs_of_each_dtype_and_layout_give_the_dtype_back(dtype):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 128, generator=g).bfloat16()
    x = torch.randn(2, 5, 3, 128, generator=g).to(dtype)[:, 1]  # [2, 3, 128], not contiguous
    got = native.gemv(x, w, "bf16", 48)
    assert got.dtype == dtype and got.shape == (2, 3, 48)
    assert _rel(got.float(), x.float() @ w.float().t()) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("kind", ["bf16", "int8", "uint4", "fp8"])
def test_bf16_inputs_are_read_and_outputs_written_as_torch_rounds_them(kind, build):
    """A bf16 model's activations go in and come out as bf16 (`tp_gemv_bf16`, no conversions around the call): the
    float32 sums of the same call on x widened, rounded to nearest even by torch, bit for bit; NaN where it is."""
    g = torch.Generator().manual_seed(12)
    n, k = 40, 256
    x = torch.randn(3, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g)
    s = torch.rand(n, 2, generator=g) + 0.1
    stored, scale, block = {"bf16": (w.bfloat16(), None, (1, 1)),
                            "int8": (torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g), s, (1, 128)),
                            "uint4": (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), s, (1, 128)),
                            "fp8": ((w * 16).to(torch.float8_e4m3fn), s[:, :1].contiguous(), (1, k))}[kind]
    x[2, 3] = float("nan")
    args = (stored, native.KINDS[kind], scale, None, *block, n, 8.0 if kind == "uint4" else 0.0, 0, True)
    want = native._run(x.float(), *args).bfloat16()
    for got in (native._run(x, *args), native.gemv(x, stored, kind, n, scale, None, block, args[-3])):
        nan = want.isnan()  # (torch's NaN bits vary with its conversion path; a NaN is what is asked)
        assert got.dtype == torch.bfloat16 and torch.equal(got.isnan(), nan) and bool(nan.any())
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_a_dense_half_layer_at_decode_computes_its_product():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 256, generator=g).bfloat16()
    x = torch.randn(1, 1, 256, generator=g).bfloat16()
    with torch.inference_mode():
        got = dense_linear(x, w)
    want = torch.nn.functional.linear(x.float(), w.float())
    assert got is None or (got.dtype == torch.bfloat16 and _rel(got.float(), want) < 1e-2)
    x.requires_grad_(True)
    assert dense_linear(x, w) is None  # a gradient asked for: torch's product
    assert dense_linear(torch.randn(16, 256).bfloat16(), w) is None  # a long input (prefill): torch's product


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_a_dense_float32_layer_at_decode_runs_the_product_chosen_and_autocast_keeps_torchs(monkeypatch, rows):
    """float32 weights take the native product where it was measured faster (forced here), to float32 rounding of
    the float64 product; under autocast torch's `F.linear` runs, whose dtype rules autocast sets."""
    from tpkit.quant import products

    monkeypatch.setattr(products, "fastest", lambda candidates, *a, **k: candidates[1])  # the native product
    monkeypatch.setattr(products, "_CHOSEN", {})
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(200, 330, generator=g), torch.randn(1, rows, 330, generator=g)
    with torch.inference_mode():
        got = products.dense_linear(x, w)
        assert got is not None and got.dtype == torch.float32 and got.shape == (1, rows, 200)
        assert _rel(got, x.double() @ w.double().t()) < 1e-6
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert products.dense_linear(x, w) is None
        for wrong in (torch.randn(1, rows, 2 * 330), x.double()):  # past the cached choice: torch's error, not a read
            assert products.dense_linear(wrong, w) is None
    assert products.dense_linear(x.requires_grad_(True), w) is None  # a gradient asked for: torch's product


def test_a_dense_half_layer_chooses_its_product_per_row_count(monkeypatch):
    """Which product wins changes with the rows (torch's bf16 product ran 1.3x faster than the native one at 1 row
    and 3x at 8 on an AMX Xeon): each row count is measured once, at its own rows, and keeps its own choice."""
    from tpkit.quant import products

    if not native.available():
        pytest.skip("no compiler: dense_linear always leaves the product to torch")
    timed = []

    def fastest(candidates, tensors, in_features, dtype, rows=1):
        timed.append(rows)
        return candidates[rows % 2]  # torch's at even rows, the native one at odd: distinguishable choices
    monkeypatch.setattr(products, "fastest", fastest)
    monkeypatch.setattr(products, "_CHOSEN", {})
    w = torch.randn(72, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.inference_mode():
        for rows in (1, 2, 3, 1, 2, 8):
            x = torch.randn(rows, 128).bfloat16()
            got = products.dense_linear(x, w)
            assert (got is None) == (rows % 2 == 0), rows
            if got is not None:
                assert _rel(got.float(), x.float() @ w.float().t()) < 1e-2
    assert timed == [1, 2, 3, 8]


def test_the_op_traces_under_compile():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(64, 128, generator=g) * 8).to(torch.float8_e4m3fn)
    s = torch.rand(1, 1, generator=g)
    f = torch.compile(lambda x: native.gemv(x, w, "fp8", 64, s, None, (64, 128)) * 2, fullgraph=True, backend="eager")
    x = torch.randn(1, 128, generator=g)
    assert _rel(f(x), 2 * x @ (w.float() * s).t()) < 1e-5
    assert _rel(torch.compile(f, backend="inductor")(x), 2 * x @ (w.float() * s).t()) < 1e-5


def test_an_input_that_asks_for_a_gradient_is_refused():
    """The product has no backward: refused, eagerly and compiled, rather than returning an output with none."""
    w = torch.randn(16, 32).bfloat16()
    x = torch.randn(1, 32, requires_grad=True)
    for f in (lambda t: native.gemv(t, w, "bf16", 16), torch.compile(lambda t: native.gemv(t, w, "bf16", 16))):
        with pytest.raises(Exception, match="no backward"):
            f(x)
    with torch.no_grad():
        assert _rel(native.gemv(x, w, "bf16", 16), x.detach() @ w.float().t()) < 1e-5


def test_fake_tensors_are_never_read():
    """A traced step (FakeTensorMode: the sizing tools') holds no data: the product gives its shape through the op's
    fake implementation, and a dense half layer prices torch's product instead of measuring (reading the fake
    tensors' addresses crashed the process)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w = torch.empty(96, 256, dtype=torch.bfloat16)
        x = torch.empty(1, 1, 256, dtype=torch.bfloat16)
        p = torch.nn.Parameter(w, requires_grad=False)  # a fake layer's weight: a parameter, fake all the same
        with torch.inference_mode():
            assert dense_linear(x, w) is None and dense_linear(x, p) is None
        assert native.gemv(x, w, "bf16", 96).shape == (1, 1, 96)
        assert native.gemv(x, p, "bf16", 96).shape == (1, 1, 96)
    assert native.fake(p) and not native.fake(torch.nn.Parameter(torch.empty(3))) and not native.fake(torch.empty(3))


def test_the_environment_picks_the_instruction_set(monkeypatch):
    """`TPKIT_NATIVE_ISA` builds the path it names (its compiler flags, `native.ISA_FLAGS`), and an unknown name is
    refused with the choices."""
    built = []
    monkeypatch.setattr(native, "build", lambda flags=(): built.append(flags) or "a product")
    for name, flags in native.ISA_FLAGS.items():
        monkeypatch.setattr(native, "_LIB", [])
        monkeypatch.setenv("TPKIT_NATIVE_ISA", name)
        assert native._function() == "a product" and built[-1] == flags
    assert native.ISA_FLAGS["avx2"] == ("-mno-avx512f",) and "-march=x86-64" in native.ISA_FLAGS["baseline"]
    assert native.ISA_FLAGS["avx512"] == ("-mno-avx512bf16", "-mno-avx512vnni")
    assert native.ISA_FLAGS["avx512-vnni"] == ("-mno-avx512bf16",)
    monkeypatch.setenv("TPKIT_NATIVE_ISA", "sse9")
    assert native.ISA_FLAGS["avx512-bf16"] == ("-mno-avx512vnni",)
    with pytest.raises(ValueError, match="TPKIT_NATIVE_ISA='sse9': choose one of native, avx512-bf16, avx512-vnni, "
                                         "avx512, avx2, baseline"):
        native.isa()


def test_a_bf16_layer_compiles_fullgraph_with_the_product_chosen(monkeypatch):
    """`torch.compile(fullgraph=True)` of a bf16 layer at decode rows traces the product its eager call chose, as one
    op (`torch.get_num_threads()` in the choice's key broke the graph at every bf16 layer, and a TP2 model's decode
    then recompiled each layer's pieces past dynamo's limit)."""
    from tpkit.quant import products

    monkeypatch.setattr(products, "_CHOSEN", {})
    monkeypatch.setattr(products, "fastest", lambda candidates, *args, **kwargs: candidates[1])  # the native one
    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, 256, generator=g).bfloat16()
    x = torch.randn(1, 1, 256, generator=g).bfloat16()
    eager = dense_linear(x, w)  # the choice, made eagerly
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm.code)
        return gm.forward

    got = torch.compile(lambda t: dense_linear(t, w), fullgraph=True, backend=backend)(x)
    assert torch.equal(got, eager) and len(graphs) == 1 and "tpkit.gemv" in graphs[0]


@pytest.mark.parametrize("native_faster", [True, False])
def test_a_bf16_layer_compiled_before_any_eager_call_chooses_its_product_as_it_traces(monkeypatch, native_faster):
    """Compiled first (no eager call made the choice): the choice is measured as the layer is traced, on a stand-in
    of the weight's shape and dtype (the traced weight is a fake tensor), and the graph holds the product chosen.
    Before, such a graph found no choice and ran `F.linear` at every bf16 layer."""
    from tpkit.quant import products

    monkeypatch.setattr(products, "_CHOSEN", {})
    measured = []

    def fastest(candidates, tensors, *args, **kwargs):
        measured.append((tuple(tensors["weight"].shape), tensors["weight"].dtype, native.fake(tensors["weight"])))
        return candidates[1 if native_faster else 0]

    monkeypatch.setattr(products, "fastest", fastest)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(80, 256, generator=g).bfloat16()
    x = torch.randn(1, 1, 256, generator=g).bfloat16()
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm.code)
        return gm.forward

    got = torch.compile(lambda t: dense_linear(t, w), fullgraph=True, backend=backend)(x)
    assert measured == [((80, 256), torch.bfloat16, False)]  # once, on real tensors
    assert any("tpkit.gemv" in code for code in graphs) == native_faster
    assert (got is None) != native_faster
    if native_faster:
        assert _rel(got.float(), x.float() @ w.float().t()) < 1e-2


def test_the_build_id_names_the_source_and_the_instruction_set(monkeypatch):
    """`build_id` (what a calibrated profile records) differs per `TPKIT_NATIVE_ISA` path and between the op's C++
    kernel and its Python one (`TPKIT_NATIVE_OP=0`), and is "torch" where no compiled product runs, so a profile
    timed on another path is known to be."""
    ids = set()
    for name in native.ISA_FLAGS:
        monkeypatch.setenv("TPKIT_NATIVE_ISA", name)
        ids.add(native.build_id())
    monkeypatch.setenv("TPKIT_NATIVE_OP", "0")
    ids.add(native.build_id())
    monkeypatch.delenv("TPKIT_NATIVE_OP")
    assert len(ids) == len(native.ISA_FLAGS) + 1 and "torch" not in ids
    monkeypatch.setattr(native, "_LIB", [None])
    assert native.build_id() == "torch"


def test_an_optional_build_that_fails_is_not_tried_again(tmp_path, monkeypatch):
    """`compile_library(..., remember_failure=True)` (the op's OpenMP build, whose serial build serves where it
    fails) marks a failed compile in the cache, and a later call under the same key does not run the compiler again;
    without the flag a failure is tried again."""
    import shutil

    real = shutil.which(os.environ.get("CC", "cc"))
    if real is None:
        pytest.skip("no C compiler here")
    calls = tmp_path / "calls"
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return }\n")
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("TPKIT_CACHE", str(tmp_path / "cache"))

    def builds() -> int:
        return sum("-shared" in line for line in calls.read_text().splitlines()) if calls.exists() else 0
    assert native.compile_library(str(broken), remember_failure=True) is None and builds() == 1
    assert native.compile_library(str(broken), remember_failure=True) is None and builds() == 1
    assert native.compile_library(str(broken)) is None and builds() == 2
