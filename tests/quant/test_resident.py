"""What a quantized load holds (issue 55 item 5): each rank holds its share of the stored bytes (plus its replicated
tensors), since the native product reads the stored tensors in place; and `tpkit.analyze` / `tpkit.estimate_memory`
count what the load holds through one rule (`tpkit.quant.resident_bytes`, what a layer keeps beside its stored
tensors), which equals what `after_loading` keeps for every kind of layer. `bench/quantized_resident.py` prints the
per-rank table."""
from __future__ import annotations

import importlib.util
import pathlib
import warnings

import pytest
import torch

import tpkit
from tpkit.comm import run_threads
from tpkit.nn.quantized import QuantizedLinear, QuantMethod, plain_layout
from tpkit.quant import WeightQuant, layer_tensors, native, resident_bytes

pytest.importorskip("compressed_tensors")
_SPEC = importlib.util.spec_from_file_location(  # the bench's measurements, so the test checks what it prints
    "bench_quantized_resident", pathlib.Path(__file__).resolve().parents[2] / "bench" / "quantized_resident.py")
BENCH = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(BENCH)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(format, dtype) -> directory, written by compressed-tensors from the bench's Qwen2 (tied embeddings)."""
    from tests.quant.checkpoints import compressed_tensors

    root, made, bases = tmp_path_factory.mktemp("resident"), {}, {}

    def get(name: str, dtype: torch.dtype) -> str:
        if (name, dtype) not in made:
            base = bases.setdefault(dtype, BENCH.model(dtype))
            kw = dict(BENCH.FORMATS[name])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                made[name, dtype] = compressed_tensors(base, str(root / f"{name}-{dtype}"), kw.pop("fmt"), **kw)
        return made[name, dtype]

    return get


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_each_rank_holds_its_share_and_the_sizing_tools_count_it(checkpoints, fmt, dtype):
    """At 2 and 3 ranks every rank holds at most 5% over its share of the stored bytes (it used to hold float32
    copies of bf16 scales and a constant zero-point table: int4 bf16 7.9% over); `analyze`'s per-rank bytes equal
    the fullest rank's held weights exactly, and so do `estimate_memory`'s."""
    path = checkpoints(fmt, dtype)

    def body(comm):
        m = tpkit.from_pretrained(path, comm=comm, progress=False)
        kept = [n for n, _ in m.named_buffers() if n.rpartition(".")[2].startswith("tp_kernel_")]
        return BENCH.held(m), BENCH.share(m), BENCH.held(m, skip=("rotary_emb",)), kept

    for world in (2, 3):
        ranks = run_threads(body, world)
        assert all(h <= 1.05 * s for h, s, _, _ in ranks), [(h, s) for h, s, _, _ in ranks]
        assert not [k for *_, kept in ranks for k in kept]  # nothing made at load beside the stored tensors
        fullest = max(w for _, _, w, _ in ranks)
        analyzed, estimated = BENCH.sizing(path, dtype, world)
        assert analyzed == fullest, (world, analyzed, fullest)
        assert estimated == fullest, (world, estimated, fullest)


def _filled(method: QuantMethod, layout) -> QuantizedLinear:
    """A layer built as a load builds it, its stored tensors random and valid, then `after_loading` as a load ends."""
    out, in_ = layout.full_shape
    layer = QuantizedLinear(in_, out, False, method, layout, device="cpu")
    g = torch.Generator().manual_seed(0)
    for name in method.specs:
        t = layer._buffers[name]
        if t.dtype == torch.int64:
            t.copy_(torch.tensor([out, in_]))
        elif t.dtype in (torch.int32, torch.int8):
            info = torch.iinfo(t.dtype)
            t.copy_(torch.randint(info.min, info.max, t.shape, dtype=t.dtype, generator=g))
        elif t.dtype == torch.float8_e4m3fn:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        else:
            t.copy_(torch.rand(t.shape, generator=g) * 0.01 + 0.001)
    method.after_loading(layer)
    return layer


INT4 = dict(layout="ct_pack", bits=4, strategy="group", group_size=64)
CASES = {  # scheme fields, compute dtype, scale dtype, (split dim, sizes, rank) or None (whole)
    "int4 sym bf16": (dict(INT4, symmetric=True), torch.bfloat16, torch.bfloat16, None),
    "int4 asym fp16": (dict(INT4, symmetric=False), torch.float16, torch.float16, (0, (64, 64), 1)),
    "int8 packed asym fp32": (dict(INT4, bits=8, symmetric=False), torch.float32, torch.float32, (1, (128, 128), 1)),
    "int8 values asym bf16": (dict(layout="ct_int", bits=8, symmetric=False, strategy="channel"), torch.bfloat16,
                              torch.bfloat16, None),
    "fp8 block bf16": (dict(layout="float", bits=8, symmetric=True, strategy="block", block=(64, 64)),
                       torch.bfloat16, torch.bfloat16, (0, (64, 64), 0)),
    "int4 a split that cuts groups (maps)": (dict(INT4, symmetric=False), torch.bfloat16, torch.bfloat16,
                                             (1, (96, 96, 64), 1)),
    "scales the kernel does not read (float32 copy)": (dict(INT4, symmetric=True), torch.bfloat16, torch.float64,
                                                       None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resident_bytes_are_what_a_loaded_layer_keeps(case):
    """`resident_bytes` (what the sizing tools add) equals the bytes a layer keeps beside its stored tensors once
    loaded: its maps (`tp_qmap_*`) and product tables (`tp_kernel_*`), nothing for the layouts the kernel reads in
    place, a float32 copy of scales it does not read."""
    fields, dtype, scale_dtype, split = CASES[case]
    scheme = WeightQuant("compressed-tensors", **fields)
    full = (128, 256)
    layout = plain_layout(full, split[0], split[1], split[2]) if split else \
        tpkit.ShardLayout.replicated(full, 1, 0)
    stored_dtypes = {scheme.scale_name: scale_dtype}
    layer = _filled(QuantMethod(scheme, dtype, stored_dtypes), layout)
    kept = sum(t.nbytes for n, t in layer.named_buffers() if n.startswith(("tp_qmap_", "tp_kernel_")))
    assert resident_bytes(scheme, layout, dtype, stored_dtypes) == kept
    tables = [n for n in layer._buffers if n.startswith("tp_kernel_")]
    has_product = bool(layer_tensors(scheme, layout, dtype, stored_dtypes).candidates)
    if case.startswith("scales the kernel"):
        assert tables == (["tp_kernel_scales"] if native.available() else []), tables
    elif case.startswith("int4 a split"):
        assert kept > 0 and not has_product and not tables
    else:  # read in place
        assert kept == 0 and (has_product or not native.available()), (kept, has_product)
