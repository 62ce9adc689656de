"""`analyze` beyond one machine (issue 25 item 5): a suggested world size larger than one node's devices is
advised as tensor parallelism inside each node and data parallelism across nodes, with the launch named."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tpkit.cli import main  # noqa: E402
from tpkit.convert import analyze  # noqa: E402
from tpkit.convert.advice.multinode import multi_node_advice  # noqa: E402

from tests.models.hf import hf_model  # noqa: E402


def _advice(report) -> list[str]:
    return [r for r in report.recommendations if "nodes" in r]


def _pin_gpus(monkeypatch, count: int) -> None:
    """Make this machine look like one with `count` GPUs (0: none) to the node-size default of `analyze`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def _budget(model) -> int:
    memory = analyze(model, world_size=2, max_world_size=8, device_memory="1GB").per_rank_memory
    return (memory[4] + memory[2]) // 2  # fits 4 ranks, not 2


def test_a_suggestion_beyond_one_node_names_the_multi_node_launch(monkeypatch):
    _pin_gpus(monkeypatch, 0)
    model = hf_model("llama")
    budget = _budget(model)
    report = analyze(model, max_world_size=8, device_memory=budget, devices_per_node=2)
    assert report.suggested_world_size == 4
    (line,) = _advice(report)
    assert "exceeds the 2 devices of one machine" in line
    assert "tp=2" in line and "dp=2" in line and "mode='fsdp'" in line
    assert "torchrun --nnodes 2 --nproc-per-node 2 --node-rank <i>" in line
    assert not _advice(analyze(model, max_world_size=8, device_memory=budget, devices_per_node=4))
    assert not _advice(analyze(model, max_world_size=8, device_memory=budget))  # no GPU: node size unknown


def test_one_device_per_machine_is_advised_as_data_parallel_only(monkeypatch):
    _pin_gpus(monkeypatch, 1)  # the node size defaults to this machine's GPUs
    model = hf_model("llama")
    report = analyze(model, max_world_size=8, device_memory=_budget(model))
    assert report.suggested_world_size == 4
    (line,) = _advice(report)
    assert "exceeds the 1 device of one machine" in line and "1 devices" not in line
    assert "tp=1" not in line and "dp=4" in line and "no tensor parallel group to keep inside a node" in line
    assert "torchrun --nnodes 4 --nproc-per-node 1 --node-rank <i>" in line
    _pin_gpus(monkeypatch, 4)
    assert not _advice(analyze(model, max_world_size=8, device_memory=_budget(model)))  # fits one machine
    nothing = multi_node_advice(None, {1: 1000, 2: 520}, 100, 1, 2)
    assert "at 1 rank (one machine)" in nothing and "--nnodes 10 --nproc-per-node 1" in nothing


def test_nothing_fits_on_one_node_says_how_many_nodes():
    memory = {1: 1000, 2: 520, 4: 270}
    line = multi_node_advice(None, memory, 100, 2, 4)
    assert "nothing up to 4 ranks fits" in line and "run on 6 nodes" in line and "--nnodes 6" in line
    assert multi_node_advice(None, memory, 600, 2, 4) is None  # one node fits: no multi-node advice
    assert multi_node_advice(8, memory, None, 2, 8) is None  # no budget known
    assert multi_node_advice(16, memory, 100, 8, 16).startswith("the suggested world size 16 exceeds the 8")


@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_bad_devices_per_node_is_refused(bad):
    with pytest.raises(ValueError, match="devices_per_node must be a positive int"):
        analyze(hf_model("llama"), devices_per_node=bad)


def test_cli_devices_per_node(capsys):
    assert main(["analyze", "llama-2-7b", "--device-memory", "4GB", "--max-world-size", "8",
                 "--devices-per-node", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "suggested world size: 8" in out and "torchrun --nnodes 4 --nproc-per-node 2" in out
