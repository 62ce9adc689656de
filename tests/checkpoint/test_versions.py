"""The version directory over many saves: `keep=N`, the remains of killed saves removed by the next one, and saves
that fail (a full disk) or die (SIGKILL) at each moment, in real processes, through the `TPKIT_FAULTS` hook."""
from __future__ import annotations

import os

import pytest
import torch

import tpkit
from tests.checkpoint.fixtures import mlp
from tests.models.hf import hf_model
from tpkit.checkpoint.manifest import versions


def _names(root) -> list[str]:
    return sorted(os.listdir(root))


def test_keep_keeps_the_newest_complete_versions(tmp_path):
    model = hf_model("llama")
    for step in range(1, 5):
        tpkit.save_sharded(model, str(tmp_path), step=step, keep=2)
    assert _names(tmp_path) == ["latest", "v000002-step-000000003", "v000003-step-000000004"]
    assert (tmp_path / "latest").read_text().strip() == "v000003-step-000000004"
    tpkit.save_sharded(model, str(tmp_path), step=5)  # keep=None: nothing complete is removed
    assert len(versions(str(tmp_path))) == 3


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_keep_must_be_a_positive_int(tmp_path, keep):
    with pytest.raises(ValueError, match="keep must be a positive int"):
        tpkit.save_sharded(hf_model("llama"), str(tmp_path), keep=keep)
    assert not os.path.exists(tmp_path / "latest")


def test_the_next_save_removes_what_killed_saves_left(tmp_path):
    model = hf_model("llama")
    tpkit.save_sharded(model, str(tmp_path), step=1)
    os.makedirs(tmp_path / "v000001-step-000000002")  # a save that died: files, no manifest
    (tmp_path / "v000001-step-000000002" / "rank-00000.safetensors").write_bytes(b"partial")
    os.makedirs(tmp_path / ".trash-v000000-1234abcd")  # a removal that died
    tpkit.save_sharded(model, str(tmp_path), step=3)
    assert _names(tmp_path) == ["latest", "v000000-step-000000001", "v000002-step-000000003"]


# ---------------------------------------------------------------------------------------------------------
# Real processes (gloo): the fault is chosen by TPKIT_FAULTS, which the spawned ranks inherit.

def _save_twice(root: str):
    """Save step 1, change the weights, save step 2 (where the fault strikes); the error each rank saw."""
    model = tpkit.parallelize(mlp())
    tpkit.save_sharded(model, root, step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    try:
        tpkit.save_sharded(model, root, step=2, keep=1)
    except tpkit.CheckpointError as exc:
        return str(exc)
    return None


def _step_one_loads(root) -> bool:
    model = mlp(seed=1)
    ok = tpkit.load_sharded(model, str(root))["step"] == 1
    return ok and all(torch.equal(v, mlp().state_dict()[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_a_full_disk_fails_the_save_on_every_rank_and_removes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TPKIT_FAULTS", "write:rank=1:step=2:do=enospc")
    messages = tpkit.launch(_save_twice, 2, backend="gloo", args=(str(tmp_path),), timeout=60)
    assert "rank-00001.safetensors: could not write it (No space left on device)" in messages[1], messages
    assert "latest still names v000000-step-000000001" in messages[1]
    assert messages[0].startswith(messages[1]) and "found by rank 1" in messages[0], messages
    assert _names(tmp_path) == ["latest", "v000000-step-000000001"]
    assert _step_one_loads(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("point, rank, complete", [("save-start", 1, False), ("save-files", 0, False),
                                                    ("save-latest", 0, True)])
def test_a_rank_killed_mid_save_leaves_the_previous_version_latest(tmp_path, monkeypatch, point, rank, complete):
    """Killed before writing, after its file is written, or after the manifest but before `latest` moves: the
    previous version stays `latest` and loads; what the dead save left (complete only in the last case) is removed
    by the next save."""
    monkeypatch.setenv("TPKIT_FAULTS", f"{point}:rank={rank}:step=2")
    with pytest.raises(tpkit.LaunchError, match=f"rank {rank} died"):
        tpkit.launch(_save_twice, 2, backend="gloo", args=(str(tmp_path),), timeout=60)
    assert (tmp_path / "latest").read_text().strip() == "v000000-step-000000001"
    assert [(name, ok) for _, name, ok in versions(str(tmp_path))] == [("v000000-step-000000001", True),
                                                                       ("v000001-step-000000002", complete)]
    assert _step_one_loads(tmp_path)
    tpkit.save_sharded(mlp(), str(tmp_path), step=3, keep=1)
    assert _names(tmp_path) == ["latest", "v000002-step-000000003"]
