"""GPUDirect RDMA: can this machine's InfiniBand cards read and write GPU memory directly?

Why: without it every transfer NCCL makes between nodes is staged through host memory, one more copy and
one more trip over PCIe each way; with it the network card moves GPU memory itself. Three facts decide it
(the seed's "IsSupported"):

- the peer-memory kernel module is loaded: `nvidia_peermem` (in the driver since 470) or the older
  `nv_peer_mem` (listed in /proc/modules);
- an InfiniBand (or RoCE) device exists (/sys/class/infiniband);
- a GPU sits near that card on PCIe. NCCL uses GPUDirect RDMA by default only when the card and the GPU
  share a PCIe switch (`NCCL_NET_GDR_LEVEL=PXB`); when the path crosses the CPU's root complex (PHB) it must
  be allowed explicitly, and across CPU sockets (SYS) it is slower than staging.

`probe_gpudirect` reports the pairs it finds with their PCIe distance, whether GPUDirect RDMA is usable,
and the NCCL settings that use it (the seed's "EnableGPUDirect": tpkit cannot load a kernel module or
reconfigure NCCL after it started, so it says what to set before launch; `tpkit env` prints it). The
distances follow `nvidia-smi topo -m`: PIX (the same bridge), PXB (the same PCIe switch tree, no host
bridge), PHB (through the root complex), NODE / SYS (different root complexes on one NUMA node / across
nodes). Every root is a parameter, so recorded samples of /sys and /proc test it.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
NVIDIA_VENDOR = "0x10de"
_DISPLAY_CLASS = "0x03"  # PCI class 03xxxx: display controllers (VGA 0300, 3D 0302); NVSwitches are bridges
DISTANCES = ("PIX", "PXB", "PHB", "NODE", "SYS")  # nearest first
NCCL_DEFAULT_GDR_LEVEL = "PXB"


@dataclasses.dataclass
class GPUDirect:
    """What `probe_gpudirect` found. `pairs`: one per (InfiniBand device, GPU), nearest first, each
    {"nic", "nic_pci", "gpu_pci", "distance"}; `nccl_env`: the settings to export before launch."""

    module: str | None
    pairs: list[dict[str, str]]
    supported: bool
    reason: str
    nccl_env: dict[str, str]
    advice: list[str]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        state = "supported" if self.supported else "not available"
        return f"GPUDirect RDMA: {state} ({self.reason})"


def loaded_peermem_module(proc_modules: Path) -> str | None:
    """The peer-memory module named in /proc/modules, or None (also when the file cannot be read)."""
    try:
        lines = proc_modules.read_text().splitlines()
    except OSError:
        return None
    loaded = {line.split()[0] for line in lines if line.strip()}
    return next((m for m in PEERMEM_MODULES if m in loaded), None)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _pci_chain(device_dir: Path) -> list[str]:
    """The PCI path of a device: its resolved sysfs directory from the root complex (`pci0000:00`) down."""
    parts = device_dir.resolve().parts
    start = next((i for i, p in enumerate(parts) if p.startswith("pci")), None)
    return list(parts[start:]) if start is not None else []


def pcie_distance(a: list[str], b: list[str], numa_a: str = "", numa_b: str = "") -> str:
    """How far apart two PCI chains are, in `nvidia-smi topo -m`'s words (see the module docstring)."""
    if not a or not b or a[0] != b[0]:
        return "NODE" if numa_a and numa_a == numa_b and numa_a != "-1" else "SYS"
    common = 0
    for x, y in zip(a, b):
        if x != y:
            break
        common += 1
    if common == 1:
        return "PHB"  # only the root complex is shared
    return "PIX" if a[:-1] == b[:-1] else "PXB"


def nvidia_gpus(pci_root: Path) -> dict[str, Path]:
    """NVIDIA display / 3D controllers under /sys/bus/pci/devices: {pci address: device dir}."""
    if not pci_root.is_dir():
        return {}
    gpus = {}
    for dev in sorted(pci_root.iterdir()):
        if _read(dev / "vendor") == NVIDIA_VENDOR and _read(dev / "class").startswith(_DISPLAY_CLASS):
            gpus[dev.name] = dev
    return gpus


def probe_gpudirect(infiniband_root: str | os.PathLike = "/sys/class/infiniband",
                    pci_root: str | os.PathLike = "/sys/bus/pci/devices",
                    proc_modules: str | os.PathLike = "/proc/modules",
                    env: dict[str, str] | None = None) -> GPUDirect:
    """Whether GPUDirect RDMA is usable here, and the NCCL settings that use it (`env`: the NCCL_* variables
    in effect, `os.environ` by default). Never raises for a missing file."""
    env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")} if env is None else env
    module = loaded_peermem_module(Path(proc_modules))
    gpus = nvidia_gpus(Path(pci_root))
    ib_root = Path(infiniband_root)
    nics = sorted(ib_root.iterdir()) if ib_root.is_dir() else []
    pairs = []
    for nic in nics:
        device = nic / "device"
        nic_chain = _pci_chain(device) if device.exists() else []
        for address, gpu in gpus.items():
            distance = pcie_distance(nic_chain, _pci_chain(gpu), _read(device / "numa_node"),
                                     _read(gpu / "numa_node"))
            pairs.append({"nic": nic.name, "nic_pci": nic_chain[-1] if nic_chain else "?", "gpu_pci": address,
                          "distance": distance})
    pairs.sort(key=lambda p: (DISTANCES.index(p["distance"]), p["nic"], p["gpu_pci"]))
    near = [p for p in pairs if p["distance"] in ("PIX", "PXB")]
    via_cpu = [p for p in pairs if p["distance"] == "PHB"]
    advice: list[str] = []
    nccl_env: dict[str, str] = {}
    if not nics:
        reason = "no InfiniBand device"
    elif not gpus:
        reason = "no NVIDIA GPU on the PCI bus"
    elif module is None:
        reason = f"no peer-memory kernel module loaded ({' or '.join(PEERMEM_MODULES)})"
        if near or via_cpu:
            advice.append("InfiniBand and GPUs share PCIe but the peer-memory module is not loaded: `modprobe "
                          "nvidia_peermem` (as root; part of the NVIDIA driver since 470) enables GPUDirect RDMA, "
                          "without it NCCL stages every inter-node transfer through host memory")
    elif not (near or via_cpu):
        reason = "no GPU shares a PCIe root complex with an InfiniBand device (every path crosses CPU sockets)"
    else:
        best = near or via_cpu
        level = best[0]["distance"] if not near else NCCL_DEFAULT_GDR_LEVEL
        hcas = sorted({p["nic"] for p in best})
        nccl_env = {"NCCL_NET_GDR_LEVEL": "PHB" if not near else level, "NCCL_IB_HCA": ",".join(hcas)}
        pairs_text = ", ".join(f"{p['nic']} <-> GPU {p['gpu_pci']} ({p['distance']})" for p in best[:4])
        reason = f"{module} loaded; {pairs_text}"
        exports = " ".join(f"{k}={v}" for k, v in nccl_env.items())
        if near:
            advice.append(f"GPUDirect RDMA is available ({pairs_text}); NCCL uses it by default up to "
                          f"NCCL_NET_GDR_LEVEL={NCCL_DEFAULT_GDR_LEVEL}. To keep NCCL on the cards next to the "
                          f"GPUs: export {exports}")
        else:
            advice.append(f"GPUDirect RDMA is possible only through the CPU root complex ({pairs_text}); NCCL "
                          f"does not use it there by default. To enable it: export {exports} (measure with "
                          f"nccl-tests: on some CPUs it is slower than staging)")
    if nccl_env:
        current = env.get("NCCL_NET_GDR_LEVEL", "")
        if current.upper() in ("LOC", "0"):
            advice.append(f"NCCL_NET_GDR_LEVEL={current} turns GPUDirect RDMA off although this machine supports "
                          f"it; unset it or set {nccl_env['NCCL_NET_GDR_LEVEL']}")
        wanted = set(nccl_env["NCCL_IB_HCA"].split(","))
        hca = env.get("NCCL_IB_HCA", "")
        named = {h.split(":")[0] for h in hca.lstrip("=").split(",")}  # "=mlx5_0:1,mlx5_1": exact names, ports
        if hca and not hca.startswith("^") and not wanted & named:
            advice.append(f"NCCL_IB_HCA={hca} names none of the cards next to the GPUs ({', '.join(sorted(wanted))})")
    return GPUDirect(module, pairs, bool(nccl_env), reason, nccl_env, advice)
