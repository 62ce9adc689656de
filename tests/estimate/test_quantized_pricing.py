"""The speed estimate of a quantized checkpoint (issue 47 item 4): each linear layer it stores packed is priced as
the product a rank's load runs: its stored bytes, its path (a kernel of its format, or the slice dequantized per
call) as the load picks it, the calibrated table of that kernel, or a stated rule for a profile without one."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os

import pytest
import torch

import tpkit
from tpkit.cli import main
from tpkit.estimate.machine import MachineRates, QuantizedRate
from tpkit.estimate.predict import Setup, kernel_times, predict, trace_setup
from tpkit.estimate.profile import SpeedProfile, load_profile, save_profile
from tpkit.estimate.quantized import DEQUANTIZE_PASSES, quantized_times
from tests.conftest import synthetic_profile

tr = pytest.importorskip("transformers")

INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}
INT8 = {**INT4, "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
    "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}}
TABLES = {"int4/bfloat16": QuantizedRate("native uint4", 20e-6, ((1, 5e9), (8, 1e9))),
          "int4/bfloat16/dequantize": QuantizedRate("dequantize", 0.0, ((1, 0.1e9),))}


def _config(quantization=None, dtype="bfloat16"):
    """A Llama of hidden 512 (4 heads of 128, 2 KV heads), MLP 1536, 2 layers, as a checkpoint's config says."""
    cfg = tr.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, dtype=dtype)
    if quantization is not None:
        cfg.quantization_config = copy.deepcopy(quantization)
    return cfg


def _int4_bytes(out: int, in_: int) -> int:
    """compressed-tensors int4 group 128 of an [out, in] slice, bf16 scales: packed words, scales, weight_shape."""
    return out * in_ // 2 + out * (in_ // 128) * 2 + 16


def _with_tables(profile: SpeedProfile, tables) -> SpeedProfile:
    return dataclasses.replace(profile, machine={k: dataclasses.replace(r, quantized=dict(tables))
                                                 for k, r in profile.machine.items()})


def _packed(op) -> bool:
    """A quantized layer's product (not a dense bf16 layer's decode product, priced by the same path)."""
    return op.quantized is not None and op.quantized.kind != "dense"


@pytest.mark.parametrize("world", [1, 2])
def test_each_product_is_priced_on_its_stored_bytes_by_the_rule_without_a_table(world):
    """No quantized table (the synthetic profile, as one measured before them): each quantized layer's op costs its
    stored bytes (counted here from the format: half a byte per weight, a bf16 scale per group of 128) at the
    weight-streaming bandwidth; the step's kernels are the dense step's less, op for op, the dense products' time
    plus that."""
    rates = synthetic_profile().rates(world)
    quant = trace_setup(_config(INT4), Setup(world), "decode", 1, 16, dtype=torch.bfloat16).rows[0][1]
    dense = trace_setup(_config(), Setup(world), "decode", 1, 16, dtype=torch.bfloat16).rows[0][1]
    assert [o.name for o in quant.ops] == [o.name for o in dense.ops]
    layers = [o for o in quant.ops if _packed(o)]
    assert len(layers) == 2 * 7 and {o.quantized.path for o in layers} == {"kernel"}  # q k v o gate up down x 2
    saved = 0.0
    for q, d in zip(quant.ops, dense.ops):
        if not _packed(q):
            continue
        m, n, k = q.mnk
        assert m == 1 and q.quantized.stored_bytes == _int4_bytes(n, k), q.quantized
        assert q.quantized.dense_bytes == n * k * 2
        assert quantized_times(q, rates) == (0.0, q.quantized.stored_bytes / rates.stream_bandwidth)
        single = dataclasses.replace(dense, ops=(d,))
        saved += sum(kernel_times(single, rates)) - q.quantized.stored_bytes / rates.stream_bandwidth
    assert saved > 0
    assert sum(kernel_times(quant, rates)) == pytest.approx(sum(kernel_times(dense, rates)) - saved, rel=1e-12)
    got = predict(_config(INT4), Setup(world), "decode", 1, 16, synthetic_profile(), dtype=torch.bfloat16)
    want = predict(_config(), Setup(world), "decode", 1, 16, synthetic_profile(), dtype=torch.bfloat16)
    assert got.seconds < want.seconds and got.overhead_s == want.overhead_s
    assert "not calibrated" in got.quantized and "a rule" in got.quantized and want.quantized == ""


def test_a_calibrated_table_prices_the_kernel_at_its_rows_and_beyond_them_the_dequantized_product():
    """With the calibration's table: fixed cost + stored bytes at the rate of the op's rows (log-linear between
    1 and 8 rows); past 8 rows the layer multiplies by its dequantized slice: the dense product plus the
    dequantization's measured time."""
    profile = _with_tables(synthetic_profile(), TABLES)
    rates = profile.rates(1)
    for batch, rate in ((1, 5e9), (8, 1e9), (4, math.exp((math.log(5e9) * 1 + math.log(1e9) * 2) / 3))):
        trace = trace_setup(_config(INT4), Setup(1), "decode", batch, 16, dtype=torch.bfloat16).rows[0][1]
        for op in (o for o in trace.ops if _packed(o)):
            assert op.mnk[0] == batch
            assert quantized_times(op, rates)[1] == pytest.approx(20e-6 + op.quantized.stored_bytes / rate, rel=1e-9)
    trace = trace_setup(_config(INT4), Setup(1), "decode", 16, 16, dtype=torch.bfloat16).rows[0][1]
    op = next(o for o in trace.ops if _packed(o))
    m, n, k = op.mnk
    dense = dataclasses.replace(trace, ops=(dataclasses.replace(op, quantized=None, nbytes=op.nbytes
                                                                - op.quantized.stored_bytes + n * k * 2),))
    dequantize = op.quantized.stored_bytes / 0.1e9
    assert sum(quantized_times(op, rates)) == pytest.approx(sum(kernel_times(dense, rates)) + dequantize, rel=1e-9)
    no_table = synthetic_profile().rates(1)  # the rule: passes over the stored and dense bytes
    rule = DEQUANTIZE_PASSES * (op.quantized.stored_bytes + n * k * 2) / no_table.copy_bandwidth
    assert sum(quantized_times(op, no_table)) == pytest.approx(sum(kernel_times(dense, no_table)) + rule, rel=1e-9)
    got = predict(_config(INT4), Setup(1), "decode", 1, 16, profile, dtype=torch.bfloat16)
    assert ("its kernel as calibrated (native uint4: the cost a call adds to the framework's linear call + the stored "
            "bytes") in got.quantized


@pytest.mark.parametrize("world", [2, 3])
def test_the_priced_path_and_bytes_are_what_each_rank_loads(tmp_path, world):
    """Against the load itself (`from_pretrained` on thread-ranks of a checkpoint compressed-tensors wrote): for
    every quantized layer the estimate's stored bytes are the rank's stored tensors, and its path is the load's
    (a kernel where the layer kept a product; dequantized where none applies: bf16 scales computed in float32)."""
    from tests.quant.checkpoints import compressed_tensors
    from tpkit.nn.quantized import quant_method_of

    config = _config()
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(config).eval().to(torch.bfloat16)
    directory = compressed_tensors(model, str(tmp_path / "int8"), "pack-quantized", num_bits=8, type="int",
                                   symmetric=True, strategy="channel")
    saved = tr.AutoConfig.from_pretrained(directory)
    for dtype in (torch.bfloat16, torch.float32):
        traced = trace_setup(saved, Setup(world), "decode", 1, 16, dtype=dtype).rows[0][1]
        priced = {q.name: (q.path, q.stored_bytes) for q in traced.quantized}

        def loaded(comm):
            m = tpkit.from_pretrained(directory, comm=comm, dtype=dtype, progress=False)
            return {n: ("dequantize" if method.kernel is None else "kernel",
                        sum(mod._buffers[s].nbytes for s in method.specs))
                    for n, mod in m.named_modules() if (method := quant_method_of(mod)) is not None}
        first = tpkit.run_threads(loaded, world)[0]
        assert priced == first, (dtype, world)
        assert {p for p, _ in first.values()} == {"kernel" if dtype == torch.bfloat16 else "dequantize"}


def test_an_old_profile_without_the_tables_loads_and_a_new_one_keeps_them(tmp_path):
    """A profile written before the quantized tables (no "quantized" key) loads and prices by the rule; one with
    them writes and reads them back unchanged."""
    path = save_profile(_with_tables(synthetic_profile(), TABLES), str(tmp_path / "new.json"))
    assert load_profile(path).rates(2).quantized == TABLES
    data = json.loads(open(path).read())
    for rates in data["machine"].values():
        del rates["quantized"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert load_profile(str(old)).rates(2).quantized == {}
    assert MachineRates.from_dict(data["machine"]["1"]).quantized == {}
    got = predict(_config(INT8), Setup(2), "decode", 1, 16, str(old), dtype=torch.bfloat16)
    assert "not calibrated" in got.quantized


def test_the_cli_prints_the_quantized_figure_and_says_what_it_priced(tmp_path, capsys):
    """`tpkit estimate` and `tpkit search` over a compressed-tensors directory: the quantized ms/token (below the
    same model's bf16 directory's, at the checkpoint's dtype by default) and a note naming the format and the
    product priced."""
    from tests.quant.checkpoints import compressed_tensors

    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(_config()).eval().to(torch.bfloat16)
    model.save_pretrained(str(tmp_path / "bf16"))
    int4 = compressed_tensors(model, str(tmp_path / "int4"), "pack-quantized", num_bits=4, type="int",
                              symmetric=True, strategy="group", group_size=128)
    rows = {}
    for name, extra in (("int4", []), ("bf16", ["--dtype", "bf16"])):
        assert main(["estimate", str(tmp_path / name), "--world-size", "1,2", "--json", *extra]) == 0
        speed = json.loads(capsys.readouterr().out)["speed"]
        rows[name] = {r["world_size"]: r["total_s"] for r in speed["rows"]}
        assert speed["dtype"] == "bfloat16"
        notes = [n for n in speed["notes"] if "stored quantized" in n]
        assert len(notes) == (name == "int4")
        if notes:
            assert "compressed-tensors int4 group 128 in bfloat16: the fastest of its products (" in notes[0]
            assert "int4" in notes[0].split("products (")[1] and "a rule" in notes[0]
    assert all(rows["int4"][t] < rows["bf16"][t] for t in (1, 2)), rows
    assert main(["estimate", int4, "--world-size", "2", "--wide"]) == 0
    out = capsys.readouterr().out
    assert "stored quantized" in out and "compressed-tensors int4 group 128" in out
    assert main(["search", int4, "--devices", "2", "--wide"]) == 0
    out = capsys.readouterr().out
    assert "stored quantized, each priced as the product a rank runs" in out
    assert os.path.exists(int4)


def test_a_rate_by_input_width_and_the_fit_anchored_at_a_tiny_call():
    """A calibrated call's rate depends on the layer's input width (log-linear between the widths timed, flat beyond;
    a profile written before widths were timed prices by its rows), survives the profile's JSON, and the fit's
    fixed cost is the tiny quantized call less the framework's linear call (never below 0)."""
    from tpkit.estimate.quantized import SIZES, _fitted, slowest

    rate = QuantizedRate("native uint8", 1e-6, ((1, 20e9), (8, 2e9)),
                         ((1024, ((1, 10e9), (8, 1e9))), (4096, ((1, 20e9), (8, 2e9)))))
    assert rate.bandwidth(1, 1024) == pytest.approx(10e9) and rate.bandwidth(1, 4096) == pytest.approx(20e9)
    assert rate.bandwidth(1, 2048) == pytest.approx(math.sqrt(10e9 * 20e9), rel=1e-9)  # log-linear in the width
    assert rate.bandwidth(1, 512) == pytest.approx(10e9) and rate.bandwidth(8, 8192) == pytest.approx(2e9)  # flat
    assert rate.bandwidth(1) == pytest.approx(20e9)  # no width: the rows
    assert rate.seconds(2e9, 1, 1024) == pytest.approx(1e-6 + 0.2)
    old = QuantizedRate("native uint8", 1e-6, ((1, 20e9),))
    assert old.bandwidth(1, 1024) == pytest.approx(20e9)
    rates = dataclasses.replace(synthetic_profile().rates(1), quantized={"int8/bfloat16": rate})
    assert MachineRates.from_dict(json.loads(json.dumps(rates.to_dict()))).quantized["int8/bfloat16"] == rate
    timed = {m: [(1e6 * (i + 1), 50e-6 + 1e6 * (i + 1) / (w * 1e9)) for i, (_, w) in enumerate(zip(SIZES, (5, 10, 4)))]
             for m in (1, 8)}
    fitted = _fitted("native uint8", timed, 50e-6, 45e-6)
    assert fitted.fixed_s == pytest.approx(5e-6)
    assert [w for w, _ in fitted.widths] == [i for _, i in SIZES]
    assert [fitted.bandwidth(1, i) for _, i in SIZES] == pytest.approx([5e9, 10e9, 4e9])
    assert _fitted("native uint8", timed, 40e-6, 45e-6).fixed_s == 0.0  # a call cheaper than the framework's adds none
    two = slowest([{"k": fitted}, {"k": dataclasses.replace(fitted, fixed_s=9e-6, widths=tuple(
        (w, tuple((m, b / 2) for m, b in rows)) for w, rows in fitted.widths))}])["k"]
    assert two.fixed_s == 9e-6 and two.bandwidth(1, SIZES[2][1]) == pytest.approx(2e9)


@pytest.mark.parametrize("bf16_terms", [False, True])
def test_a_calls_fixed_cost_is_what_it_adds_to_the_framework_terms_linear_call(monkeypatch, bf16_terms):
    """The calibration sets each decode product's tiny call against the linear call of the framework terms that
    price its models (a layer of their tiny model, `framework_linear_call`): bf16's where decoding's terms are
    measured in bf16 too, else float32's; for quantized and dense layers alike. Not against a dense call of the
    layer's own dtype, whose slow tiny bf16 product once hid every bf16 call's cost."""
    from tpkit.estimate import framework, quantized

    assert framework.tiny_config("llama", 1).hidden_size == quantized.FRAMEWORK_WIDTH
    assert 0 < quantized.framework_linear_call(1, lambda: None, torch.bfloat16) < 1e-3
    monkeypatch.setattr(quantized, "framework_dtypes", lambda quick: (torch.float32, torch.bfloat16)[:1 + bf16_terms])
    monkeypatch.setattr(quantized, "framework_linear_call", lambda repeats, barrier, dtype: {
        torch.float32: 2e-6, torch.bfloat16: 3e-6}[dtype])
    monkeypatch.setattr(quantized, "_tiny_call", lambda *args: 9e-6)  # a quantized layer's tiny call
    timed = quantized._per_call
    monkeypatch.setattr(quantized, "_per_call", lambda calls, repeats, barrier: 7e-6 if len(calls) == 200 else
                        timed(calls, 1, barrier))  # 200 calls: the dense layer's tiny call
    table = quantized.measure_quantized(quick=True)
    base = 3e-6 if bf16_terms else 2e-6
    assert [table[k].fixed_s for k in ("int4/bfloat16", "int8/bfloat16")] == pytest.approx([9e-6 - base] * 2)
    assert table["dense/bfloat16"].fixed_s == pytest.approx(7e-6 - base)


def test_the_calibrations_fp8_layers_hold_values_as_a_checkpoint_does():
    """Each row's largest value at FP8's largest, as a per-channel checkpoint stores them: unscaled values made 1%
    FP8 subnormals, denormal inputs the CPU multiplies in microcode, and the calibration priced FP8 at 1.2 GB/s."""
    from tpkit.estimate.quantized import _layer

    layer, method = _layer("fp8", torch.bfloat16, torch.bfloat16, 256, 512, torch.Generator().manual_seed(0))
    w = next(layer._buffers[n] for n in method.specs if layer._buffers[n].dtype == torch.float8_e4m3fn).float()
    assert w.abs().amax(-1).eq(torch.finfo(torch.float8_e4m3fn).max).all()
    assert (w.abs() < 2 ** -6).float().mean() < 1e-3  # subnormals and zeros: a few in 10^4 at most


def test_a_profile_measured_with_another_product_build_says_so(tmp_path):
    """A calibration records the compiled product it timed (`native.build_id`: its source and instruction set), and
    the profile keeps it through a save and a load. An estimate priced by a profile measured with another build (an
    older `gemv.c`, another `TPKIT_NATIVE_ISA`) says so and names the way to measure again; one measured with this
    build, or before builds were recorded, says nothing."""
    from tpkit.quant import native

    for build, noted in (("0123456789ab", True), (native.build_id(), False), ("", False)):
        base = synthetic_profile()
        profile = dataclasses.replace(base, machine={k: dataclasses.replace(r, product_build=build)
                                                     for k, r in base.machine.items()})
        path = save_profile(profile, str(tmp_path / f"profile{build}.json"))
        assert load_profile(path).rates(1).product_build == build
        est = tpkit.estimate_speed(_config(INT4), [1, 2], mode="decode", seq_len=16, profile=path)
        notes = [n for n in est.notes if "another build of tpkit's compiled product" in n]
        assert len(notes) == noted, est.notes
        if noted:
            assert build in notes[0] and native.build_id() in notes[0] and "tpkit estimate --calibrate" in notes[0]
    assert native.build_id() != "torch" or not native.available()


def test_a_calibration_whose_bandwidth_moved_says_so(tmp_path):
    """A calibration measures the streaming bandwidth again at its end (`stream_bandwidth_end`, kept through a save
    and a load, printed with the terms): an estimate priced by a profile whose bandwidth moved by more than
    `STREAM_DRIFT` either way says so with both figures; within it, or measured once (a profile from before), it
    says nothing."""
    from tpkit.estimate.speed import STREAM_DRIFT
    from tpkit.estimate.terms import profile_terms

    base = synthetic_profile()
    start = base.machine["2"].stream_bandwidth
    for end, noted in ((start * 0.6, True), (start * 1.4, True), (start * (1 + STREAM_DRIFT / 2), False),
                       (0.0, False)):
        profile = dataclasses.replace(base, machine={k: dataclasses.replace(r, stream_bandwidth_end=end
                                                                            * r.stream_bandwidth / start)
                                                     for k, r in base.machine.items()})
        path = save_profile(profile, str(tmp_path / f"profile{end}.json"))
        loaded = load_profile(path)
        assert loaded.rates(2).stream_bandwidth_end == pytest.approx(end)
        streaming = [line for line in profile_terms(loaded) if "weight streaming bandwidth" in line]
        assert len(streaming) == 2 and all(("at the end" in line) == bool(end) for line in streaming)
        est = tpkit.estimate_speed(_config(INT4), [1, 2], mode="decode", seq_len=16, profile=path)
        notes = [n for n in est.notes if "memory bandwidth moved during the calibration" in n]
        assert len(notes) == noted, est.notes
        if noted:  # (both rank counts moved alike: the note names the first, one rank alone)
            one = profile.machine["1"]
            assert (f"(1 rank reading: {one.stream_bandwidth / 1e9:.1f} GB/s per rank at its start, "
                    f"{one.stream_bandwidth_end / 1e9:.1f} at its end)") in notes[0]
