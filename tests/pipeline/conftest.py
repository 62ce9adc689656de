"""One launch of 4 gloo processes for the pipeline tests of test_train.py and test_checkpoint.py (and a pp setup
applied, for test_decisions.py): a launch costs 10-30 s on this 2-core box, so the cases share one
(`cases.run_all`)."""
from __future__ import annotations

import pytest

import tpkit
from tests.pipeline.cases import CASES, MODELS, run_all


@pytest.fixture(scope="session")
def launched(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pipeline")
    dirs = {}
    for name in ("llama", "qwen_tied"):
        dirs[name] = str(root / f"hf-{name}")
        MODELS[name]().save_pretrained(dirs[name])
    per_rank = tpkit.launch(run_all, 4, backend="gloo", args=(CASES, dirs["llama"], dirs["qwen_tied"],
                                                               str(root / "ck")), pass_comm=True, timeout=120)
    return {"per_rank": per_rank, "checkpoints": str(root / "ck")}
