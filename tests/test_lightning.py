"""examples/lightning_tp.py: tpkit inside a PyTorch Lightning Trainer (conversion in `configure_model`,
ModelParallelStrategy, gloo, 2 CPU processes) trains exactly as a plain single-process loop.

Lightning is an optional extra (`pip install 'tpkit[lightning]'`); `make test` installs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

try:
    import lightning  # noqa: F401
    HAVE_LIGHTNING = True
except ImportError:
    HAVE_LIGHTNING = False

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not HAVE_LIGHTNING, reason="lightning is not installed: pip install 'tpkit[lightning]' "
                                                            "(make test installs it)")]


def test_lightning_example_losses_equal_the_plain_loop(tmp_path):
    out = tmp_path / "losses.json"
    src = str(ROOT / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "lightning_tp.py"), "--steps", "4", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "losses equal the plain loop" in proc.stdout, output[-2000:]
    data = json.loads(out.read_text())
    lightning_losses, plain = data["lightning"], data["plain"]
    assert len(lightning_losses) == 2 and lightning_losses[0] == lightning_losses[1]  # both TP ranks, one loss
    assert len(plain) == 4 and plain[0] != plain[-1]  # it trained
    for ours, ref in zip(lightning_losses[0], plain):
        assert abs(ours - ref) <= 1e-4 * abs(ref), (lightning_losses[0], plain)
    assert data["q_proj_local_shape"] == [32, 64]  # the model really was split: half of q_proj's 64 rows
