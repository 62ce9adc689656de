"""Training that survives, with real processes: a peer that dies inside a collective makes every surviving rank raise
CommError within the timeout and exit; `examples/train_2d.py` under `torchrun --max-restarts` gets through a rank
killed mid-step (inside the forward, its peer waiting in a collective) and a full disk during a save, and ends with
the parameters and losses of an uninterrupted run, bit for bit. (Kills at each moment of a save:
tests/checkpoint/test_versions.py; a damaged newest version: tests/checkpoint/test_checkpointer.py; the tp2 x dp2
soak with random faults: bench/soak.py.)"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.torchrun import ROOT, assert_peers_raise_comm_error, spawn_world, torchrun

EXAMPLE = os.path.join(ROOT, "examples", "train_2d.py")
TIMEOUT = 20.0

PEER_SCRIPT = '''
import os, time, torch, tpkit
from tpkit import faults

comm = tpkit.init("gloo", timeout=float(os.environ["PEER_TIMEOUT"]))
torch.manual_seed(0)
up, down = tpkit.nn.ColumnParallelLinear(16, 48), tpkit.nn.RowParallelLinear(48, 16)
at = {"step": 0}
down.register_forward_pre_hook(lambda m, a: faults.at("forward", comm.rank, at["step"]))
x = torch.randn(4, 16)
for step in range(5):
    at["step"] = step
    start = time.perf_counter()
    try:
        down(torch.relu(up(x))).sum().backward()   # the peers of a rank that dies wait in down's all-reduce
    except tpkit.CommError as exc:
        print(f"rank {comm.rank}: CommError after {time.perf_counter() - start:.1f}s: {exc}", flush=True)
        raise
print(f"rank {comm.rank}: finished", flush=True)
'''


@pytest.mark.slow
@pytest.mark.parametrize("shm", ["1", "0"])
def test_a_peer_dying_inside_a_collective(tmp_path, shm):
    """No launcher to stop them (as on another node): the survivors must notice, raise CommError, and exit."""
    script = tmp_path / "peer.py"
    script.write_text(PEER_SCRIPT)
    ranks = spawn_world(str(script), nproc=3, timeout=90,
                        env={"TPKIT_FAULTS": "forward:rank=1:step=2", "PEER_TIMEOUT": str(TIMEOUT), "TPKIT_SHM": shm})
    assert_peers_raise_comm_error(ranks, 1, "forward (step 2", TIMEOUT)


def _final(directory: str, out: str) -> dict[str, torch.Tensor]:
    """The parameters of the newest version, consolidated."""
    from safetensors.torch import load_file

    import tpkit

    tpkit.consolidate(directory, out)
    return load_file(os.path.join(out, "model.safetensors"))


def _losses(history: str) -> dict[int, float]:
    """Step -> loss, the last record of each step (a step re-run after a restart logs again: it must agree)."""
    out = {}
    with open(history) as f:
        for line in f:
            row = json.loads(line)
            assert out.get(row["step"], row["loss"]) == row["loss"], row  # re-runs are bit for bit the same
            out[row["step"]] = row["loss"]
    return out


ARGS = ("--tp", "2", "--mode", "ddp", "--steps", "8", "--every", "2", "--keep", "2", "--resume",
        "--global-batch", "4", "--seq", "16", "--vocab", "256", "--dropout", "0.1", "--timeout", str(TIMEOUT),
        "--check-replicas", "1")  # every step checked: no replica of this dropout, ddp run may drift


@pytest.mark.slow
def test_torchrun_restarts_through_faults_and_ends_as_an_uninterrupted_run(tmp_path):
    runs = {}
    for name, faults in (("clean", ""), ("faulty", "forward:rank=1:step=3:generation=0; "
                                                    "write:rank=0:step=6:generation=1:do=enospc")):
        code, output, seconds = torchrun(EXAMPLE, *ARGS, "--save", str(tmp_path / name), "--history",
                                         str(tmp_path / f"{name}.jsonl"), nproc=2, max_restarts=2,
                                         env={"TPKIT_FAULTS": faults} if faults else None, timeout=240)
        assert code == 0, output
        runs[name] = output
    faulty = runs["faulty"]
    assert "killing rank 1 at forward (step 3, generation 0)" in faulty  # mid-step, its peer inside a collective
    assert "generation 1, starting at step 2" in faulty  # the last complete version before the kill
    assert "rank-00000.safetensors: could not write it (No space left on device)" in faulty
    assert "generation 2, starting at step 4" in faulty  # the full disk's save was removed; step 4 stayed latest
    assert sorted(os.listdir(tmp_path / "faulty")) == ["latest", "v000002-step-000000006", "v000003-step-000000008"]
    assert _losses(str(tmp_path / "faulty.jsonl")) == _losses(str(tmp_path / "clean.jsonl"))
    clean, got = _final(str(tmp_path / "clean"), str(tmp_path / "hf-clean")), \
        _final(str(tmp_path / "faulty"), str(tmp_path / "hf-faulty"))
    assert clean.keys() == got.keys() and all(torch.equal(got[k], clean[k]) for k in clean)
