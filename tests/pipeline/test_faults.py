"""A stage rank that dies mid-step (SIGKILL inside its forward, `tpkit.faults`) makes every other rank of the
pipeline raise `tpkit.CommError` within the timeout, whether it waits for an activation (the next stage) or for a
gradient (the previous one). Ranks started with no launcher to stop them, as on other nodes."""
from __future__ import annotations

import pytest

from tests.torchrun import assert_peers_raise_comm_error, spawn_world

TIMEOUT = 20.0
SCRIPT = '''
import os, time, torch, tpkit
from tpkit import faults
from tests.pipeline.cases import batch, llama

comm = tpkit.init("gloo", timeout=float(os.environ["PEER_TIMEOUT"]))
pipe = tpkit.pipeline(llama(), comm, pp=3, schedule="1f1b", microbatches=4)
at = {"step": 0}
pipe.stages[0].first_block.register_forward_pre_hook(lambda m, a: faults.at("forward", comm.rank, at["step"]))
for step in range(4):
    at["step"] = step
    start = time.perf_counter()
    try:
        pipe.step(batch(step), batch(step))
    except tpkit.CommError as exc:
        print(f"rank {comm.rank}: CommError after {time.perf_counter() - start:.1f}s: {exc}", flush=True)
        raise
    for p in pipe.model.parameters():
        p.grad = None
print(f"rank {comm.rank}: finished", flush=True)
'''


@pytest.mark.slow
def test_a_stage_dying_mid_step_makes_the_others_raise_comm_error(tmp_path):
    script = tmp_path / "stage.py"
    script.write_text(SCRIPT)
    ranks = spawn_world(str(script), nproc=3, timeout=120,
                        env={"TPKIT_FAULTS": "forward:rank=1:step=2", "PEER_TIMEOUT": str(TIMEOUT)})
    assert_peers_raise_comm_error(ranks, 1, "forward (step 2", TIMEOUT)
