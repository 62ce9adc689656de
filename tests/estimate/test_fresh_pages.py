"""New pages for tensors the allocator does not keep: the op trace counts the outputs of at least
`FRESH_BLOCK_BYTES` each op makes (`Op.fresh`), the calibration measures what their pages cost
(`measure_fresh_bandwidth`), and the price adds it. The count is checked against the kernel's own count of the
pages a real training step faults in."""
from __future__ import annotations

import dataclasses
import platform
import resource

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tpkit.estimate.bandwidth import measure_fresh_bandwidth
from tpkit.estimate.fake_step import loss_of, trace_step
from tpkit.estimate.machine import MachineRates
from tpkit.estimate.ops import FRESH_BLOCK_BYTES, OpRecorder
from tpkit.estimate.predict import kernel_times

PAGE = 4096
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _fresh(fn) -> float:
    """The fresh bytes the ops of `fn(big, small, kept)` record (every op's: metadata ops record none)."""
    with FakeTensorMode():
        big = torch.empty(FRESH_BLOCK_BYTES // 4)
        small = torch.empty(FRESH_BLOCK_BYTES // 8)
        kept = torch.empty_like(big)
        recorder = OpRecorder("forward")
        with recorder:
            fn(big, small, kept)
    assert recorder.ops
    return sum(op.fresh for op in recorder.ops)


def test_only_new_outputs_of_at_least_the_block_size_are_fresh():
    assert _fresh(lambda big, small, kept: torch.sqrt(big)) == FRESH_BLOCK_BYTES
    assert _fresh(lambda big, small, kept: torch.sqrt(small)) == 0  # the heap keeps it
    assert _fresh(lambda big, small, kept: torch.sqrt(big, out=kept)) == 0  # written into a kept one
    assert _fresh(lambda big, small, kept: big.add_(1)) == 0  # in place
    assert _fresh(lambda big, small, kept: big.view(2, -1)) == 0
    assert _fresh(lambda big, small, kept: torch._foreach_sqrt([big, small, big])) == 2 * FRESH_BLOCK_BYTES


class _Wide(nn.Module):
    """One weight just over the block size (its gradient and AdamW's temporaries are fresh), one well under."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4096, 2304, bias=False)   # 37.7 MB
        self.down = nn.Linear(2304, 64, bias=False)   # 0.6 MB

    def forward(self, x):
        return self.down(self.up(x))


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _real_step_faults() -> list[int]:
    """Minor faults of 5 real training steps of `_Wide`, in a fresh process: glibc serves a large block from heap
    memory an earlier test freed (the pytest worker's history) without faulting, so a worker's count varies."""
    torch.manual_seed(0)
    model, x = _Wide(), torch.randn(8, 4096)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counts = []
    for _ in range(5):
        before = _minor_faults()
        loss_of(model(x)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counts.append(_minor_faults() - before)
    return counts


@pytest.mark.skipif(not GLIBC, reason="the block size is glibc's mmap threshold")
def test_the_traced_fresh_bytes_are_the_pages_a_real_step_faults_in():
    """The kernel's count of minor faults in a real training step (forward, backward, AdamW, gradients set to None,
    as the traced step runs it) against the traced fresh bytes: the gradient of the wide weight and AdamW's two
    temporaries of its size, 3 x 9216 pages."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    trace = trace_step(_Wide(), "train", example=(torch.randn(8, 4096),))
    fresh = {phase: sum(o.fresh for o in trace.ops if o.phase == phase) for phase in ("forward", "backward", "optimizer")}
    weight = 4096 * 2304 * 4
    assert fresh == {"forward": 0, "backward": weight, "optimizer": 2 * weight}
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as fresh_process:
        counts = fresh_process.submit(_real_step_faults).result(timeout=300)
    pages = sorted(counts[2:])[1]  # steady steps: the first ones make the optimizer's states
    predicted = sum(fresh.values()) / PAGE
    assert 0.9 * predicted <= pages <= 1.15 * predicted + 500, (counts, predicted)


def test_the_price_adds_the_fresh_pages_at_the_measured_rate():
    trace = trace_step(_Wide(), "train", example=(torch.randn(8, 4096),))
    fresh = sum(o.fresh for o in trace.ops)
    rates = MachineRates(1, 1, 1e-6, 1e-6, ((1, 1e10), (1024, 1e11)), 1e10, 1e10)
    without = kernel_times(trace, rates)
    with_pages = kernel_times(trace, dataclasses.replace(rates, fresh_bandwidth=2e9))
    assert with_pages[0] == without[0]  # bound by the memory system, not arithmetic
    assert with_pages[1] - without[1] == pytest.approx(fresh / 2e9)
    assert MachineRates.from_dict(dataclasses.replace(rates, fresh_bandwidth=2e9).to_dict()).fresh_bandwidth == 2e9
    assert MachineRates.from_dict({k: v for k, v in rates.to_dict().items() if k != "fresh_bandwidth"}) \
        .fresh_bandwidth == 0  # a profile measured before: no such term


@pytest.mark.skipif(not GLIBC, reason="glibc unmaps a freed block this large; another allocator may keep it")
def test_the_calibration_measures_a_plausible_cost_per_new_page():
    rate = measure_fresh_bandwidth(repeats=3)
    # a page faulted and zeroed by the kernel: 0.1-10 us per 4 KiB page on any machine this runs on
    assert PAGE / 10e-6 < rate < PAGE / 0.1e-6, rate
