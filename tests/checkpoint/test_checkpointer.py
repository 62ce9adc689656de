"""Checkpointer: a run interrupted and resumed equals the uninterrupted run bit for bit (parameters, AdamW state,
LR schedule, dropout and every random stream); the newest complete version is taken, a damaged one is skipped
with a warning; `every` and `keep`."""
from __future__ import annotations

import os
import pathlib
import random

import numpy as np
import pytest
import torch

import tpkit
from tpkit.checkpoint.manifest import versions

STEPS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)  # the data is a function of the step
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _run(directory, stop_at: int | None, every: int = 2, keep: int | None = 2):
    """Train to STEPS (or stop after `stop_at`), resuming from `directory`; the parameters and what the random
    streams gave."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(6)
    ckpt = tpkit.Checkpointer(directory, every=every, keep=keep)
    start = ckpt.resume(model, opt, sched)
    draws = []
    for step in range(start, STEPS if stop_at is None else stop_at):
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y) * (1 + random.random() + float(np.random.rand()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        draws.append(torch.rand(1).item())
        ckpt.maybe_save(step + 1, model, opt, sched, extra={"seen": step + 1})
    return {n: p.detach().clone() for n, p in model.named_parameters()}, draws, start, ckpt.extra


def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path):
    ref, ref_draws, _, _ = _run(str(tmp_path / "a"), None)
    _, first, _, _ = _run(str(tmp_path / "b"), 4)
    got, rest, start, extra = _run(str(tmp_path / "b"), None)
    assert start == 4 and extra == {"seen": 4}
    assert first + rest == ref_draws
    assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_nothing_saved_starts_at_zero(tmp_path):
    assert tpkit.Checkpointer(str(tmp_path / "none"), every=5).resume(_model(), None) == 0


def test_every_and_keep(tmp_path):
    _run(str(tmp_path), None, every=2, keep=2)
    assert [n for _, n, _ in versions(str(tmp_path))] == ["v000001-step-000000004", "v000002-step-000000006"]


def test_the_newest_complete_version_is_taken_even_before_latest_moved(tmp_path):
    """A save killed between its manifest and `latest` is complete: resume takes it."""
    _run(str(tmp_path), None, keep=None)
    (tmp_path / "latest").write_text("v000000-step-000000002\n")
    assert _run(str(tmp_path), None)[2] == STEPS


def _flip_a_byte(version, name: str = "rank-00000.safetensors") -> None:
    """In the first tensor after the header (a model parameter)."""
    f = version / name
    data = bytearray(f.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 5] ^= 0x10
    f.write_bytes(bytes(data))


def test_a_damaged_newest_version_falls_back_with_a_warning(tmp_path):
    ref, _, _, _ = _run(str(tmp_path / "ref"), 4)
    _run(str(tmp_path / "run"), None)
    _flip_a_byte(tmp_path / "run" / "v000002-step-000000006")
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match=r"v000002-step-000000006 does not load \(.*sha256"):
        step = tpkit.Checkpointer(str(tmp_path / "run"), every=2).resume(model, opt)
    assert step == 4 and all(torch.equal(p, ref[n]) for n, p in model.named_parameters())


def test_no_loadable_version_is_an_error_not_a_fresh_start(tmp_path):
    _run(str(tmp_path), None)
    for _, name, _ in versions(str(tmp_path)):
        _flip_a_byte(tmp_path / name)
    with pytest.warns(UserWarning), pytest.raises(tpkit.CheckpointError, match="no complete version loads"):
        tpkit.Checkpointer(str(tmp_path), every=2).resume(_model(), None)


def test_extra_must_be_json(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match="must be JSON"):
        tpkit.Checkpointer(str(tmp_path), every=1).save(1, model, None, extra={"x": object()})
    assert not os.path.exists(tmp_path / "latest")


# ---------------------------------------------------------------------------------------------------------
# Real processes (gloo), a TP model: a damaged newest version falls back on every rank alike.

def _tp_train(directory: str, steps: int):  # a TP MLP (16 -> 32 -> 16) on _batch's data
    """Resume, train to `steps` with a save every 2; this rank's parameters after step 2, the step resumed from and
    the warnings."""
    import warnings

    from tests.checkpoint.fixtures import mlp

    model = tpkit.parallelize(mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = tpkit.Checkpointer(directory, every=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = ckpt.resume(model, opt)
    at_two = {n: p.detach().clone() for n, p in model.named_parameters()} if start == 2 else None
    for step in range(start, steps):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(model(torch.cat([x, x], 1)), torch.cat([y] * 4, 1)).backward()
        opt.step()
        opt.zero_grad()
        ckpt.maybe_save(step + 1, model, opt)
        if step + 1 == 2:
            at_two = {n: p.detach().clone() for n, p in model.named_parameters()}
    return at_two, start, [str(w.message) for w in caught]


def _train_damage_resume(directory: str):
    """Train to 4 (saves at 2 and 4); rank 0 damages rank 1's file of the newest version; resume anew."""
    first, _, _ = _tp_train(directory, 4)
    comm = tpkit.get_communicator()
    comm.barrier()
    if comm.rank == 0:
        _flip_a_byte(pathlib.Path(directory) / "v000001-step-000000004", "rank-00001.safetensors")
    comm.barrier()
    return (first,) + _tp_train(directory, 2)


@pytest.mark.slow
def test_a_damaged_newest_version_falls_back_on_every_gloo_rank(tmp_path):
    for rank, (first, at_two, start, caught) in enumerate(
            tpkit.launch(_train_damage_resume, 2, backend="gloo", args=(str(tmp_path),), timeout=60)):
        assert start == 2 and all(torch.equal(at_two[n], first[n]) for n in at_two)
        if rank == 0:
            assert any("v000001-step-000000004 does not load" in w and "rank-00001" in w for w in caught), caught
