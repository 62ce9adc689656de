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
