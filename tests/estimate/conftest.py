"""Fixtures of the estimate tests."""
from __future__ import annotations

import contextlib
import io

import pytest


# seconds a test that may build `quick_calibration` may take: the calibration measured 60-110 s on a 2-core Intel
# Xeon; on a 2-core AMD EPYC (Zen 3) 265 s alone before its matmul tables stopped re-reading memory for compute-bound
# rows, 110-130 s after, 229 s beside the other pytest worker; the suite's 300 s timed it out there
CALIBRATION_TIMEOUT = 900


@pytest.fixture(scope="session")
def quick_calibration(tmp_path_factory) -> tuple[str, str]:
    """`tpkit estimate --calibrate --quick --backend gloo` with $TPKIT_PROFILE set, run once for the session (it
    measures this machine: `CALIBRATION_TIMEOUT`), shared by the tests that check what a quick calibration prints
    and writes and by the user sequence, whose first estimate would make the same measurement: (the profile path,
    $TPKIT_PROFILE's, it wrote; its stdout). Tests copy the profile before using it."""
    from tpkit.cli import main

    path = str(tmp_path_factory.mktemp("calibrated") / "profile.json")
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setenv("TPKIT_PROFILE", path)
        assert main(["estimate", "--calibrate", "--quick", "--backend", "gloo"]) == 0
    return path, out.getvalue()
