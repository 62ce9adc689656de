"""`products.fastest` times each candidate from memory, not from cache: every call reads the next of copies of the
layer's tensors, `COLD_BYTES` in all, with the layer's own values; a candidate whose hot call is already no faster
than the best cold one is not timed cold; the faster candidate is kept per shape."""
from __future__ import annotations

import time

import pytest
import torch

from tpkit.quant import products
from tpkit.quant.format import Product


class Recorded(Product):
    """A candidate that records the tensors each call reads and sleeps `hot` seconds a call on the layer's own
    weight (`own`: as if in cache), `cold` seconds on a copy of it (as if read from memory)."""

    def __init__(self, name: str, own: torch.Tensor, hot: float, cold: float):
        self.name, self.own, self.hot, self.cold, self.seen = name, own.data_ptr(), hot, cold, []

    def key(self):
        return (self.name,)

    def resident(self, tensors):
        return dict(tensors)

    def __call__(self, x, t):
        self.seen.append(t["weight"])
        time.sleep(self.hot if t["weight"].data_ptr() == self.own else self.cold)
        return x @ t["weight"].T


HOT_CALLS = 4  # `_hot`: an untimed call and 3 timed, on the layer's own tensors


@pytest.mark.parametrize("rows,k", [(64, 96), (2048, 2048)])
def test_each_timed_call_reads_another_copy_past_the_caches(rows, k, monkeypatch):
    monkeypatch.setattr(products, "_CHOSEN", {})
    weight = torch.randn(rows, k)
    # in cache the first is the faster, from memory the second (as torch's F.linear against the native product on a
    # weight that fits the L3); 5 ms apart: far above a cold 16 MB read's noise on a loaded CI box
    cached, streaming = Recorded("cached", weight, 0.0, 6e-3), Recorded("streaming", weight, 1e-3, 1e-3)
    assert products.fastest([cached, streaming], {"weight": weight}, k, torch.float32) is streaming
    copies = min(max(products.COLD_BYTES // weight.nbytes, 2), 64)
    for candidate in (cached, streaming):
        assert all(t.data_ptr() == weight.data_ptr() for t in candidate.seen[:HOT_CALLS])
        timed = candidate.seen[HOT_CALLS:]
        assert len(timed) == 3 * (copies + 1)  # 3 rounds, each warming up on the last copy first
        distinct = {t.data_ptr() for t in timed}
        assert len(distinct) == copies and weight.data_ptr() in distinct
        assert copies * weight.nbytes >= min(products.COLD_BYTES, 64 * weight.nbytes)
        assert all(torch.equal(t, weight) for t in timed)
    calls = len(streaming.seen)
    products.fastest([cached, streaming], {"weight": weight}, k, torch.float32)  # kept: not measured again
    assert len(streaming.seen) == calls


def test_a_candidate_slower_hot_than_the_best_cold_is_not_timed_cold(monkeypatch):
    """(torch's int4 kernel repacks its weight on every call: timed over the copies it cost an int4 load 0.7 s)"""
    monkeypatch.setattr(products, "_CHOSEN", {})
    weight = torch.randn(64, 96)
    fast, hopeless = Recorded("fast", weight, 0.0, 1e-4), Recorded("hopeless", weight, 8e-3, 8e-3)
    assert products.fastest([hopeless, fast], {"weight": weight}, 96, torch.float32) is fast
    assert len(hopeless.seen) == HOT_CALLS and len(fast.seen) > HOT_CALLS


def test_int4_load_keeps_the_native_product_and_skips_timing_the_repacking_kernel_cold(monkeypatch):
    """The compressed-tensors int4 candidates of a real layer: torch's kernel (repacking per call) is timed hot only;
    the native product wins and is timed from memory. At one thread, as a rank of a full host runs: the suite's
    workers share the cores, and a product split over threads waited for a descheduled one (it lost once so)."""
    from tpkit.quant import compressed_tensors, native

    if not native.available():
        pytest.skip("no compiler: the native product is not built here")
    monkeypatch.setattr(products, "_CHOSEN", {})
    calls = []
    real = compressed_tensors.int4_linear
    monkeypatch.setattr(compressed_tensors, "int4_linear", lambda *a: (calls.append(1), real(*a))[1])
    g, out, k = 128, 1024, 2048
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(-2**31, 2**31 - 1, (out, k // 8), generator=gen, dtype=torch.int32)
    scale = torch.rand(out, k // g, generator=gen).bfloat16()
    q = compressed_tensors.WeightQuant(compressed_tensors.METHOD, "ct_pack", 4, True, "group", group_size=g)
    candidates = compressed_tensors.CompressedTensors().products(q, (out, k), False, torch.bfloat16, torch.bfloat16)
    assert [type(c) for c in candidates] == [products.Native, compressed_tensors._Int4]
    tensors = {"weight_packed": packed, "weight_scale": scale}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        chosen = products.fastest(candidates, tensors, k, torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    assert chosen is candidates[0] and len(calls) == HOT_CALLS
