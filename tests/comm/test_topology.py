"""topology() on a machine without a GPU, the nvidia-smi parser, InfiniBand probing, advice, `tpkit env`."""
from __future__ import annotations

import json

import pytest
import torch

from tpkit.cli import main
from tpkit.comm import topology
from tpkit.comm.topology import parse_nvidia_smi_topo

SMI = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV12\tSYS\tNV6\tPXB\t0-31\t0
GPU1\tNV12\t X \tPHB\tSYS\tSYS\t0-31\t0
GPU2\tSYS\tPHB\t X \tNV12\tSYS\t32-63\t1
GPU3\tNV6\tSYS\tNV12\t X \tSYS\t32-63\t1
NIC0\tPXB\tSYS\tSYS\tSYS\t X
"""


def test_parse_nvidia_smi_topo_finds_nvlink_pairs():
    parsed = parse_nvidia_smi_topo(SMI)
    assert parsed["gpus"] == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert parsed["links"] == {(0, 1): "NV12", (0, 3): "NV6", (2, 3): "NV12"}
    assert parsed["matrix"][1] == ["NV12", "X", "PHB", "SYS"]
    assert parse_nvidia_smi_topo("No devices were found") == {"gpus": [], "matrix": [], "links": {}}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU report")
def test_report_without_gpu_never_raises_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    topo = topology(infiniband_root=tmp_path / "missing")
    assert topo.devices == [] and topo.peer_access == [] and topo.infiniband == []
    assert topo.nccl_env["NCCL_DEBUG"] == "INFO"
    assert any("cuda.is_available() is False" in n for n in topo.notes)
    assert any("NCCL_DEBUG=INFO" in a for a in topo.advice)
    text = topo.summary()
    assert "no CUDA device" in text and "infiniband: none" in text and "NCCL_DEBUG=INFO" in text
    json.dumps(topo.to_dict())


def test_infiniband_present_but_disabled_gives_advice(tmp_path, monkeypatch):
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    for key in [k for k in list(__import__("os").environ) if k.startswith("NCCL_")]:
        monkeypatch.delenv(key)
    assert not any("InfiniBand" in a for a in topology(infiniband_root=tmp_path, run_nvidia_smi=False).advice)
    monkeypatch.setenv("NCCL_IB_DISABLE", "1")
    topo = topology(infiniband_root=tmp_path, run_nvidia_smi=False)
    assert topo.infiniband == [{"name": "mlx5_0", "state": "4: ACTIVE", "rate": "200 Gb/sec (4X HDR)"}]
    assert any("NCCL_IB_DISABLE=1" in a and "mlx5_0" in a for a in topo.advice)
    assert "mlx5_0 (4: ACTIVE, 200 Gb/sec (4X HDR))" in topo.summary()


def test_tpkit_env_prints_the_report(capsys):
    assert main(["env", "--no-nvidia-smi"]) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "devices:" in out and "NCCL environment" in out and "advice" in out
    assert main(["env", "--json", "--no-nvidia-smi"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"devices", "peer_access", "nvlink", "infiniband", "nccl_env", "advice"}


# -- GPUDirect RDMA on recorded sysfs / procfs samples ---------------------------------------------------------
def _device(path, vendor, pci_class, numa="0"):
    path.mkdir(parents=True)
    (path / "vendor").write_text(vendor + "\n")
    (path / "class").write_text(pci_class + "\n")
    (path / "numa_node").write_text(numa + "\n")
    return path


def _machine(tmp_path, module="nvidia_peermem", gpus=("switch", "root", "socket"), nic="mlx5_0"):
    """A recorded /sys and /proc: one PCIe switch (upstream 0000:01:00.0) under root port 0000:00:01.0 holding the
    InfiniBand card 0000:04:00.0 and, as asked, a GPU beside it ("switch", 0000:03:00.0), a GPU on another root
    port of the same root complex ("root", 0000:05:00.0), a GPU on the other socket ("socket", 0000:81:00.0);
    plus an NVSwitch and a BMC's VGA controller, which are not GPUs."""
    sys_root, proc_root = tmp_path / "sys", tmp_path / "proc"
    root = sys_root / "devices" / "pci0000:00"
    switch = root / "0000:00:01.0" / "0000:01:00.0"
    made = {"nic": _device(switch / "0000:02:01.0" / "0000:04:00.0", "0x15b3", "0x020700"),
            "nvswitch": _device(switch / "0000:02:02.0" / "0000:06:00.0", "0x10de", "0x068000"),
            "bmc": _device(root / "0000:00:1c.0" / "0000:07:00.0", "0x1a03", "0x030000")}
    where = {"switch": switch / "0000:02:00.0" / "0000:03:00.0", "root": root / "0000:00:02.0" / "0000:05:00.0",
             "socket": sys_root / "devices" / "pci0000:80" / "0000:80:01.0" / "0000:81:00.0"}
    for kind in gpus:
        made[kind] = _device(where[kind], "0x10de", "0x030200", numa="1" if kind == "socket" else "0")
    bus = sys_root / "bus" / "pci" / "devices"
    bus.mkdir(parents=True)
    for path in made.values():
        (bus / path.name).symlink_to(path)
    if nic:
        port = sys_root / "class" / "infiniband" / nic / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n")
        (port.parent.parent / "device").symlink_to(made["nic"])
    proc_root.mkdir()
    lines = ["ib_core 434176 8 ib_uverbs,mlx5_ib, Live 0x0000000000000000"]
    if module:
        lines.append(f"{module} 16384 0 - Live 0x0000000000000000")
    (proc_root / "modules").write_text("\n".join(lines) + "\n")
    return sys_root, proc_root


def _probe(sys_root, proc_root, env=None):
    from tpkit.comm.gpudirect import probe_gpudirect

    return probe_gpudirect(sys_root / "class" / "infiniband", sys_root / "bus" / "pci" / "devices",
                           proc_root / "modules", env={} if env is None else env)


def test_gpudirect_with_a_gpu_beside_the_card(tmp_path):
    gdr = _probe(*_machine(tmp_path))
    assert gdr.supported and gdr.module == "nvidia_peermem"
    assert [(p["nic"], p["gpu_pci"], p["distance"]) for p in gdr.pairs] == [
        ("mlx5_0", "0000:03:00.0", "PXB"), ("mlx5_0", "0000:05:00.0", "PHB"), ("mlx5_0", "0000:81:00.0", "SYS")]
    assert gdr.pairs[0]["nic_pci"] == "0000:04:00.0"
    assert gdr.nccl_env == {"NCCL_NET_GDR_LEVEL": "PXB", "NCCL_IB_HCA": "mlx5_0"}
    assert len(gdr.advice) == 1 and "export NCCL_NET_GDR_LEVEL=PXB NCCL_IB_HCA=mlx5_0" in gdr.advice[0]
    assert "nvidia_peermem loaded; mlx5_0 <-> GPU 0000:03:00.0 (PXB)" in gdr.reason


def test_gpudirect_needs_the_peer_memory_module(tmp_path):
    gdr = _probe(*_machine(tmp_path, module=None))
    assert not gdr.supported and gdr.nccl_env == {} and "no peer-memory kernel module" in gdr.reason
    assert any("modprobe nvidia_peermem" in a for a in gdr.advice)
    older = _probe(*_machine(tmp_path / "older", module="nv_peer_mem"))
    assert older.supported and older.module == "nv_peer_mem"


def test_gpudirect_through_the_root_complex_must_be_enabled(tmp_path):
    gdr = _probe(*_machine(tmp_path, gpus=("root", "socket")))
    assert gdr.supported and gdr.nccl_env == {"NCCL_NET_GDR_LEVEL": "PHB", "NCCL_IB_HCA": "mlx5_0"}
    assert "does not use it there by default" in gdr.advice[0] and "NCCL_NET_GDR_LEVEL=PHB" in gdr.advice[0]
    far = _probe(*_machine(tmp_path / "far", gpus=("socket",)))
    assert not far.supported and "crosses CPU sockets" in far.reason and far.pairs[0]["distance"] == "SYS"


def test_gpudirect_absent_pieces_and_contrary_settings(tmp_path):
    assert _probe(*_machine(tmp_path / "a", nic=None)).reason == "no InfiniBand device"
    assert _probe(*_machine(tmp_path / "b", gpus=())).reason == "no NVIDIA GPU on the PCI bus"
    machine = _machine(tmp_path / "c")
    gdr = _probe(*machine, env={"NCCL_NET_GDR_LEVEL": "LOC", "NCCL_IB_HCA": "=mlx5_9:1"})
    assert any("NCCL_NET_GDR_LEVEL=LOC turns GPUDirect RDMA off" in a for a in gdr.advice)
    assert any("NCCL_IB_HCA==mlx5_9:1 names none of the cards next to the GPUs (mlx5_0)" in a for a in gdr.advice)
    assert len(_probe(*machine, env={"NCCL_IB_HCA": "mlx5_0:1,mlx5_1"}).advice) == 1  # names the right card
    from tpkit.comm.gpudirect import probe_gpudirect

    nothing = probe_gpudirect(tmp_path / "x", tmp_path / "y", tmp_path / "z", env={})  # missing files: no error
    assert not nothing.supported and nothing.pairs == []


def test_pcie_distances_follow_nvidia_smi():
    from tpkit.comm.gpudirect import pcie_distance

    a = ["pci0000:00", "0000:00:01.0", "0000:01:00.0"]
    assert pcie_distance(a, ["pci0000:00", "0000:00:01.0", "0000:01:00.1"]) == "PIX"  # the same bridge
    assert pcie_distance(a + ["x"], ["pci0000:00", "0000:00:01.0", "0000:02:00.0"]) == "PXB"
    assert pcie_distance(a, ["pci0000:00", "0000:00:02.0", "0000:03:00.0"]) == "PHB"
    assert pcie_distance(a, ["pci0000:40", "0000:40:01.0"], "0", "0") == "NODE"
    assert pcie_distance(a, ["pci0000:80", "0000:80:01.0"], "0", "1") == "SYS"


def test_topology_and_tpkit_env_report_gpudirect(tmp_path, capsys, monkeypatch):
    for key in [k for k in list(__import__("os").environ) if k.startswith("NCCL_")]:
        monkeypatch.delenv(key)
    sys_root, proc_root = _machine(tmp_path)
    topo = topology(infiniband_root=sys_root / "class" / "infiniband", run_nvidia_smi=False,
                    pci_root=sys_root / "bus" / "pci" / "devices", proc_modules=proc_root / "modules")
    assert topo.gpudirect["supported"] and any("GPUDirect RDMA is available" in a for a in topo.advice)
    assert "GPUDirect RDMA: supported (nvidia_peermem loaded" in topo.summary()
    args = ["env", "--no-nvidia-smi", "--sys-root", str(sys_root), "--proc-root", str(proc_root)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "GPUDirect RDMA: supported" in out and "  export NCCL_NET_GDR_LEVEL=PXB NCCL_IB_HCA=mlx5_0" in out
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpudirect"]["nccl_env"] == {"NCCL_NET_GDR_LEVEL": "PXB", "NCCL_IB_HCA": "mlx5_0"}
    assert main(["env", "--no-nvidia-smi", "--sys-root", str(tmp_path / "none"), "--proc-root", str(tmp_path)]) == 0
    assert "GPUDirect RDMA: not available (no InfiniBand device)" in capsys.readouterr().out
