"""`topology()`: what carries the bytes on this machine, and what is likely misconfigured.

Why: a TP group that crosses PCIe instead of NVLink, or an InfiniBand card that NCCL was told not to use,
costs more than any algorithm choice wins back. This gathers the facts (devices, CUDA peer access, NVLink
links from `nvidia-smi topo -m`, InfiniBand devices from /sys/class/infiniband, GPUDirect RDMA support
(`gpudirect.py`), the NCCL_* variables in effect) and turns the common mistakes into advice lines. Every probe is optional: a machine without a
GPU, nvidia-smi or InfiniBand gets a report saying so, never an exception.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

from .gpudirect import probe_gpudirect


@dataclasses.dataclass
class Topology:
    devices: list[dict[str, Any]]
    peer_access: list[list[bool]]  # [i][j]: device i can access device j's memory directly
    nvlink: dict[str, Any] | None  # {"gpus": [...], "matrix": [[link str]], "links": {(i, j): "NV12"}} or None
    infiniband: list[dict[str, Any]]
    nccl_env: dict[str, str]
    advice: list[str]
    notes: list[str]  # what could not be probed, and why
    gpudirect: dict[str, Any] = dataclasses.field(default_factory=dict)  # GPUDirect.to_dict()

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.nvlink is not None:
            out["nvlink"] = dict(self.nvlink, links={f"{i}-{j}": v for (i, j), v in self.nvlink["links"].items()})
        return out

    def summary(self) -> str:
        lines = [f"devices: {len(self.devices)} CUDA device(s)" if self.devices else "devices: no CUDA device"]
        for d in self.devices:
            lines.append(f"  cuda:{d['index']} {d['name']} {d['memory_gib']:.1f} GiB, capability {d['capability']}")
        if self.peer_access:
            lines.append("peer access:")
            for i, row in enumerate(self.peer_access):
                lines.append(f"  cuda:{i} -> " + " ".join("X" if i == j else ("yes" if ok else "no")
                                                       for j, ok in enumerate(row)))
        if self.nvlink is not None:
            nv = self.nvlink["links"]
            lines.append(f"nvlink: {len(nv)} GPU pair(s) connected by NVLink" if nv else "nvlink: none")
            for (i, j), v in sorted(nv.items()):
                lines.append(f"  GPU{i} <-> GPU{j}: {v}")
        ib = ", ".join(f"{d['name']} ({d.get('state', '?')}, {d.get('rate', '?')})" for d in self.infiniband)
        lines.append(f"infiniband: {ib or 'none'}")
        if self.gpudirect:
            state = "supported" if self.gpudirect["supported"] else "not available"
            lines.append(f"GPUDirect RDMA: {state} ({self.gpudirect['reason']})")
        lines.append("NCCL environment: " + (", ".join(f"{k}={v}" for k, v in sorted(self.nccl_env.items()))
                                             or "no NCCL_* variables set"))
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"advice: {a}" for a in self.advice] or ["advice: nothing to change"]
        return "\n".join(lines)


def parse_nvidia_smi_topo(text: str) -> dict[str, Any]:
    """Parse `nvidia-smi topo -m`: GPU names, the link matrix, and the NVLink pairs (entries `NV<k>`)."""
    rows = [line.split("\t") if "\t" in line else line.split() for line in text.splitlines()]
    rows = [[c.strip() for c in r if c.strip()] for r in rows]
    header = next((r for r in rows if r and r[0].startswith("GPU")), None)
    if header is None:
        return {"gpus": [], "matrix": [], "links": {}}
    gpus = [c for c in header if c.startswith("GPU")]
    matrix, links = [], {}
    for r in rows:
        if not r or r[0] not in gpus or r is header:
            continue
        i = gpus.index(r[0])
        cells = r[1:1 + len(gpus)]
        matrix.append(cells)
        for j, cell in enumerate(cells):
            if cell.startswith("NV") and i < j:
                links[(i, j)] = cell
    return {"gpus": gpus, "matrix": matrix, "links": links}


def _infiniband(root: Path) -> list[dict[str, Any]]:
    out = []
    if not root.is_dir():
        return out
    for dev in sorted(root.iterdir()):
        info: dict[str, Any] = {"name": dev.name}
        port = dev / "ports" / "1"
        for key in ("state", "rate", "link_layer"):
            f = port / key
            if f.is_file():
                info[key] = f.read_text().strip()
        out.append(info)
    return out


def _advice(devices, peer, nvlink, ib, env) -> list[str]:
    advice = []
    if ib and env.get("NCCL_IB_DISABLE", "0") not in ("", "0"):
        advice.append(f"InfiniBand devices {[d['name'] for d in ib]} are present but NCCL_IB_DISABLE="
                      f"{env['NCCL_IB_DISABLE']}: NCCL falls back to TCP sockets across nodes; unset it")
    active = [d for d in ib if "ACTIVE" in str(d.get("state", "")).upper()]
    if ib and not active:
        advice.append("InfiniBand devices are present but no port is ACTIVE; check the cable / subnet manager")
    if env.get("NCCL_P2P_DISABLE", "0") not in ("", "0") and len(devices) > 1:
        advice.append("NCCL_P2P_DISABLE is set: GPU-to-GPU copies go through host memory; unset it for TP")
    if env.get("NCCL_SHM_DISABLE", "0") not in ("", "0"):
        advice.append("NCCL_SHM_DISABLE is set: intra-node traffic without P2P uses sockets instead of shared memory")
    if env.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE"):
        advice.append(f"NCCL_DEBUG={env['NCCL_DEBUG']} logs on every rank; use WARN outside debugging")
    if len(devices) > 1 and peer and not all(peer[i][j] for i in range(len(peer)) for j in range(len(peer)) if i != j):
        advice.append("some GPU pairs have no peer access: keep each TP group on GPUs that can reach each other "
                      "(tensor parallelism is the most communication-heavy split)")
    if len(devices) > 1 and nvlink is not None and not nvlink["links"]:
        advice.append("no NVLink between GPUs: TP all-reduces run over PCIe; prefer small TP sizes (2) and "
                      "pipeline or data parallelism across the rest")
    return advice


def topology(infiniband_root: str | os.PathLike = "/sys/class/infiniband", run_nvidia_smi: bool = True,
             pci_root: str | os.PathLike = "/sys/bus/pci/devices",
             proc_modules: str | os.PathLike = "/proc/modules") -> Topology:
    """Probe this machine (see module docstring); never raises for a missing GPU, tool or file. The roots are
    parameters so recorded samples of /sys and /proc can stand in for the machine's."""
    notes: list[str] = []
    devices: list[dict[str, Any]] = []
    peer: list[list[bool]] = []
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        for i in range(count):
            p = torch.cuda.get_device_properties(i)
            devices.append({"index": i, "name": p.name, "memory_gib": p.total_memory / 2**30,
                            "capability": f"{p.major}.{p.minor}"})
        peer = [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(count)] for i in range(count)]
    else:
        notes.append("torch.cuda.is_available() is False: no devices, no peer-access matrix")
    nvlink = None
    smi = shutil.which("nvidia-smi") if run_nvidia_smi else None
    if smi:
        try:
            text = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
            nvlink = parse_nvidia_smi_topo(text)
        except (OSError, subprocess.SubprocessError) as exc:
            notes.append(f"nvidia-smi topo -m failed: {exc}")
    else:
        notes.append("nvidia-smi not found: NVLink unknown")
    ib = _infiniband(Path(infiniband_root))
    env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    gdr = probe_gpudirect(infiniband_root, pci_root, proc_modules, env)
    return Topology(devices, peer, nvlink, ib, env, _advice(devices, peer, nvlink, ib, env) + gdr.advice, notes,
                    gdr.to_dict())
