"""Training helpers: clip_grad_norm_ (global norm over shards and replicas == single-device norm, for p = 2, 1,
inf) and the RNG rules for dropout (sharded: different per rank; replicated: identical; default stream untouched)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpkit
from tpkit.comm import run_threads
from tpkit.layout import Piece, ShardLayout
from tpkit.nn import (DATA_PARALLEL_RNG, ColumnParallelLinear, ModelRecord, RowParallelLinear, attach_record,
                      clip_grad_norm_, get_rng_tracker, model_parallel_manual_seed)

from .helpers import FP64_TOL, THREAD_SIZES, assert_small, local_slice, randn, rel_err, run, seeded_linear


def clip_checks() -> dict:
    r = tpkit.get_communicator().rank
    errors = {}
    for norm_type in (2.0, 1.0, math.inf):
        for max_norm in (1e-2, 1e6):  # clips / leaves alone
            # a sharded layer (gathering its output) feeding a replicated one
            ref = nn.Sequential(seeded_linear(6, 10, True, 1), seeded_linear(10, 7, True, 3))
            tp = nn.Sequential(ColumnParallelLinear.from_module(seeded_linear(6, 10, True, 1), gather_output=True),
                               seeded_linear(10, 7, True, 3))
            x = randn((4, 6), 9)
            ref(x).pow(2).sum().backward()
            tp(x).pow(2).sum().backward()
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
            got = clip_grad_norm_(tp.parameters(), max_norm, norm_type)
            tag = f"p={norm_type} max={max_norm}"
            errors[f"{tag} norm"] = rel_err(got, want)
            errors[f"{tag} clipped W"] = rel_err(tp[0].weight.grad, local_slice(ref[0].weight.grad, 0,
                                                                               tp[0].partition_sizes, r))
            errors[f"{tag} clipped replicated"] = rel_err(tp[1].weight.grad, ref[1].weight.grad)
    # Row layer: sharded weight + replicated bias, and a parameter without a gradient.
    ref, tp = seeded_linear(10, 4, True, 5), RowParallelLinear.from_module(seeded_linear(10, 4, True, 5),
                                                                          input_is_parallel=False)
    frozen = nn.Parameter(torch.ones(3, dtype=torch.float64))
    x = randn((3, 10), 2)
    ref(x).sum().backward(), tp(x).sum().backward()
    errors["row norm"] = rel_err(clip_grad_norm_([*tp.parameters(), frozen], 0.5),
                                 torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
    return errors


@pytest.mark.parametrize("world_size", THREAD_SIZES)
def test_clip_grad_norm_matches_single_device_threads(world_size):
    assert_small(run(clip_checks, world_size, "threads"), FP64_TOL)


def test_clip_grad_norm_errors():
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([float("inf"), 1.0])
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_: the total norm of order 2\.0 is inf"):
        clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    with pytest.raises(ValueError, match=r"clip_grad_norm_: norm_type -1\.0 must be positive or inf"):
        clip_grad_norm_([p], 1.0, norm_type=-1)
    with pytest.raises(ValueError, match=r"clip_grad_norm_: max_norm -1 must be non-negative"):
        clip_grad_norm_([p], -1)
    assert float(clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0)) == 0.0  # no gradients: norm 0


def dropout_checks(processes: bool) -> dict:
    """Masks of each stream on this rank, and whether the default stream was left alone by the forks."""
    comm = tpkit.get_communicator()
    tracker = model_parallel_manual_seed(1234)
    ones = torch.ones(4096)
    default_before = torch.get_rng_state() if processes else None
    with tracker.fork():
        sharded = [F.dropout(ones, 0.5), F.dropout(ones, 0.5)]
    with tracker.fork(DATA_PARALLEL_RNG):
        replicated_stream = F.dropout(ones, 0.5)
    out = {"rank": comm.rank, "sharded": sharded, "replicated_stream": replicated_stream}
    if processes:  # a process owns its default generator: it must be untouched by the forks and equal on all ranks
        out["default_untouched"] = torch.equal(torch.get_rng_state(), default_before)
        out["replicated_default"] = F.dropout(ones, 0.5)
        torch.manual_seed(1234 + 2718 + comm.rank)
        out["expected_sharded"] = F.dropout(ones, 0.5)
    assert get_rng_tracker() is tracker
    return out


def check_dropout_results(results: list[dict], processes: bool) -> None:
    first = results[0]
    assert not torch.equal(first["sharded"][0], first["sharded"][1]), "a stream must advance between forks"
    for res in results[1:]:
        assert not torch.equal(res["sharded"][0], first["sharded"][0]), "sharded dropout must differ across ranks"
        assert torch.equal(res["replicated_stream"], first["replicated_stream"])
        if processes:
            assert torch.equal(res["replicated_default"], first["replicated_default"])
    for res in results:
        assert 0.4 < float((res["sharded"][0] == 0).float().mean()) < 0.6
        if processes:
            assert res["default_untouched"] and torch.equal(res["sharded"][0], res["expected_sharded"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_dropout_rng_rules_threads(world_size):
    check_dropout_results(run(dropout_checks, world_size, "threads", False), processes=False)


@pytest.fixture
def restored_global_rng():
    """model_parallel_manual_seed seeds the global RNG too; leave it as it was for the tests after this one."""
    with torch.random.fork_rng():
        yield


def test_rng_tracker_errors_and_state_roundtrip(restored_global_rng):
    tracker = model_parallel_manual_seed(7)
    with pytest.raises(ValueError, match=r"RNG tracker: stream 'data-parallel-rng' already exists"):
        tracker.add(DATA_PARALLEL_RNG, 99)
    with pytest.raises(ValueError, match=r"RNG tracker: seed 7 is already used by another stream"):
        tracker.add("other", 7)
    with pytest.raises(ValueError, match=r"RNG tracker: no stream 'missing'.*model_parallel_manual_seed"):
        with tracker.fork("missing"):
            pass
    saved = tracker.get_states()
    with tracker.fork():
        first = torch.rand(5)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(5), first)


def test_clip_grad_norm_counts_replicated_slices_once():
    """Rows that several ranks hold (replicated KV heads) count once in the global norm, for p = 2, 1 and inf."""
    full = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    rows = {0: [0, 1, 2], 1: [0, 1, 3]}  # rows 0 and 1 live on both ranks
    for norm_type in (2.0, 1.0, float("inf")):
        expected = torch.linalg.vector_norm(full, norm_type)

        def body(comm, norm_type=norm_type):
            holder = torch.nn.Module()
            holder.w = torch.nn.Parameter(full[rows[comm.rank]].clone())
            holder.w.grad = holder.w.detach().clone()
            pieces = (Piece.whole(0, 2, 2), Piece(2, 2, ((0, 1), (1, 2))))  # rows 0, 1 on both; 2 on 0; 3 on 1
            attach_record(holder, ModelRecord(comm, {"w": ShardLayout((4, 3), 2, comm.rank, 0, pieces)}))
            return clip_grad_norm_([holder.w], 1e9, norm_type)

        for norm in run_threads(body, 2):
            torch.testing.assert_close(norm, expected, rtol=1e-12, atol=0)
