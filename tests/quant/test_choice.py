"""`products.fastest` times each candidate from memory, not from cache: every call reads the next of copies of the
layer's tensors, `COLD_BYTES` in all, with the layer's own values; the faster candidate is kept per shape."""
from __future__ import annotations

import pytest
import torch

from tpkit.quant import products
from tpkit.quant.format import Product


class Recorded(Product):
    """A candidate that records the tensors each call reads (and sleeps `delay` seconds a call)."""

    def __init__(self, name: str, delay: float):
        self.name, self.delay, self.seen = name, delay, []

    def key(self):
        return (self.name,)

    def resident(self, tensors):
        return dict(tensors)

    def __call__(self, x, t):
        import time

        self.seen.append(t["weight"])
        time.sleep(self.delay)
        return x @ t["weight"].T


@pytest.mark.parametrize("rows,k", [(64, 96), (2048, 2048)])
def test_each_timed_call_reads_another_copy_past_the_caches(rows, k, monkeypatch):
    monkeypatch.setattr(products, "_CHOSEN", {})
    weight = torch.randn(rows, k)
    # (5 ms a call: far above a cold 16 MB read's noise on a loaded CI box, where 0.2 ms once lost to it)
    slow, fast = Recorded("slow", 5e-3), Recorded("fast", 0.0)
    assert products.fastest([slow, fast], {"weight": weight}, k, torch.float32) is fast
    for candidate in (slow, fast):
        timed = candidate.seen[1:]  # (the first call of each round warms up on the last copy)
        distinct = {t.data_ptr() for t in timed}
        copies = min(max(products.COLD_BYTES // weight.nbytes, 2), 64)
        assert len(distinct) == copies and weight.data_ptr() in distinct
        assert copies * weight.nbytes >= min(products.COLD_BYTES, 64 * weight.nbytes)
        assert all(torch.equal(t, weight) for t in timed)
    calls = len(fast.seen)
    products.fastest([slow, fast], {"weight": weight}, k, torch.float32)  # kept: not measured again
    assert len(fast.seen) == calls
