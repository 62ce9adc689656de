"""Hardware figures for the speed estimate: one accelerator and the link between accelerators.

The presets are datasheet peaks (NVIDIA A100, H100 and H200 datasheets): dense bf16/fp16 tensor-core
throughput (no 2:4 sparsity), HBM bandwidth and capacity, and per-GPU link bandwidth in ONE direction
(NVLink is sold as a bidirectional total: 600 GB/s for A100 NVLink 3 is 300 GB/s each way; 900 GB/s for
H100/H200 NVLink 4 is 450 GB/s each way; PCIe gen4 x16 is ~32 GB/s each way, gen5 x16 ~64 GB/s). A ring
all-reduce streams in one direction per link, so the one-way figure is the one the cost model needs.

Latencies (`latency_s`, the per-hop alpha of the alpha-beta model) are not on datasheets; the presets use
typical per-hop figures of NCCL rings (a few microseconds over NVLink, more through PCIe and the host). What
kernels and collectives actually reach (a fraction of these peaks, a fixed cost per collective, the per-hop
latency calibrated against published runs) lives in the speed profile (`profile.py`), keyed by `kind`.

`datasheet_rates` turns a datasheet and those fractions into the rates a calibration measures on a machine at hand
(`machine.MachineRates`), so a GPU known only by its datasheet is priced by the same op-by-op composition as a
measured machine (`predict.py`): matmuls at the fraction of peak, every other op at the fraction of HBM bandwidth,
ring collectives, no fixed cost per op.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .machine import COLLECTIVES, CollectiveCost, MachineRates

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Interconnect:
    """A link between two accelerators: one-way bandwidth per GPU (bytes/s) and per-hop latency (s)."""

    name: str
    bandwidth: float
    latency_s: float
    kind: str = "nvlink"   # what the speed profile's calibrated link figures are keyed by


@dataclass(frozen=True)
class Hardware:
    """One accelerator with its link: peak dense FLOP/s (16-bit and fp32), HBM bytes/s and bytes."""

    name: str
    peak_flops_16bit: float
    peak_flops_fp32: float
    memory_bandwidth: float
    memory_bytes: int
    interconnect: Interconnect

    def peak_flops(self, bytes_per_element: int) -> float:
        """Peak for the element size: 16-bit types run on the tensor cores, fp32 uses the TF32 cores."""
        return self.peak_flops_16bit if bytes_per_element <= 2 else self.peak_flops_fp32

    def with_interconnect(self, interconnect: str | Interconnect) -> "Hardware":
        """The same accelerator on another link (`"nvlink"`, `"pcie"`, or an `Interconnect`)."""
        if isinstance(interconnect, str):
            interconnect = _interconnect_for(self.name, interconnect)
        return replace(self, interconnect=interconnect)


NVLINK3 = Interconnect("NVLink 3 (300 GB/s per direction)", 300 * GB, 2e-6)
NVLINK4 = Interconnect("NVLink 4 (450 GB/s per direction)", 450 * GB, 2e-6)
PCIE4 = Interconnect("PCIe gen4 x16 (32 GB/s per direction)", 32 * GB, 5e-6, "pcie")
PCIE5 = Interconnect("PCIe gen5 x16 (64 GB/s per direction)", 64 * GB, 5e-6, "pcie")

# TF32 dense peaks stand for fp32: A100 156 TFLOP/s, H100/H200 SXM 494.7 TFLOP/s.
HARDWARE: dict[str, Hardware] = {
    "A100-80GB": Hardware("A100-80GB", 312 * TB, 156 * TB, 2039 * GB, 80 * 1024**3, NVLINK3),
    "H100-SXM": Hardware("H100-SXM", 989.4 * TB, 494.7 * TB, 3350 * GB, 80 * 1024**3, NVLINK4),
    "H200": Hardware("H200", 989.4 * TB, 494.7 * TB, 4800 * GB, 141 * 1000**3, NVLINK4),
}

_LINKS = {"A100-80GB": {"nvlink": NVLINK3, "pcie": PCIE4},
          "H100-SXM": {"nvlink": NVLINK4, "pcie": PCIE5},
          "H200": {"nvlink": NVLINK4, "pcie": PCIE5}}


def _interconnect_for(hardware_name: str, kind: str) -> Interconnect:
    links = _LINKS.get(hardware_name, {"nvlink": NVLINK4, "pcie": PCIE5})
    key = kind.lower().replace("-", "")
    if key not in links:
        raise ValueError(f"unknown interconnect {kind!r}; choose one of {sorted(links)} or pass an Interconnect")
    return links[key]


def get_hardware(hardware: str | Hardware, interconnect: str | Interconnect | None = None) -> Hardware:
    """A preset by name (case-insensitive) or a user `Hardware`, optionally moved onto another link."""
    if isinstance(hardware, Hardware):
        hw = hardware
    else:
        by_lower = {name.lower(): hw for name, hw in HARDWARE.items()}
        if hardware.lower() not in by_lower:
            raise ValueError(f"unknown hardware {hardware!r}; presets are {sorted(HARDWARE)}, "
                             "or pass tpkit.estimate.hardware.Hardware(...) with your own figures")
        hw = by_lower[hardware.lower()]
    return hw if interconnect is None else hw.with_interconnect(interconnect)


def datasheet_rates(hw: Hardware, flops_efficiency: float, memory_efficiency: float, link, ranks: int,
                    bytes_per_element: int = 2) -> MachineRates:
    """One rank's rates on `hw` from its datasheet and a profile's achieved fractions (`link`: the profile's
    `LinkProfile` for `hw`'s link), for a machine measured nowhere: matmuls at the fraction of peak for the element
    size, weights and elementwise work at the fraction of HBM bandwidth, no fixed cost per op (a GPU queues its
    kernels ahead; captured or compiled decoding pays none), and ring collectives over g ranks: the link's fixed
    cost per collective, then an all-reduce of n bytes in 2(g-1) hops moving 2(g-1)/g n, an all-gather of an n-byte
    input in g-1 hops moving (g-1) n, a reduce-scatter of an n-byte input in g-1 hops moving (g-1)/g n."""
    peak = hw.peak_flops(bytes_per_element) * flops_efficiency
    hbm = hw.memory_bandwidth * memory_efficiency
    link_bw = hw.interconnect.bandwidth * link.bandwidth_efficiency
    collectives: dict[str, dict[str, CollectiveCost]] = {k: {} for k in COLLECTIVES}
    for g in range(2, max(ranks, 2) + 1):
        hops = g - 1
        fixed, ring = link.collective_latency_s, hops * link.hop_latency_s
        collectives["all_reduce"][str(g)] = CollectiveCost(fixed + 2 * ring, link_bw * g / (2 * hops))
        collectives["all_gather"][str(g)] = CollectiveCost(fixed + ring, link_bw / hops)
        collectives["reduce_scatter"][str(g)] = CollectiveCost(fixed + ring, link_bw * g / hops)
    return MachineRates(ranks, 0, 0.0, 0.0, ((1, peak), (1024, peak)), hbm, hbm, collectives)


def detect_hardware() -> Hardware | None:
    """The preset of the first CUDA device when its name says which (A100, H100, H200); None on a CPU host or an
    unknown GPU (those are measured, never guessed)."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0).upper()
    return next((hw for key, hw in HARDWARE.items() if key.split("-")[0] in name), None)


def local_devices() -> tuple[int, str]:
    """(how many, what) a setup on this machine can use: its GPUs, else the cores this process may run on (one
    rank per core: ranks sharing a core only wait for each other)."""
    import os

    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), "GPUs"
    try:
        return len(os.sched_getaffinity(0)), "cores"
    except (AttributeError, OSError):
        return os.cpu_count() or 1, "cores"
