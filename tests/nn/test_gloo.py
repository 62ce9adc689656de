"""The same checks as the threads tests, on real gloo processes: one launch per world size runs them all (each
process launch costs seconds), and the parent asserts on what every rank returns."""
from __future__ import annotations

import pytest

import tpkit

from .helpers import FP32_TOL, FP64_TOL, assert_small, run
from .test_conv import conv_checks
from .test_cross_entropy import ce_bf16_checks, ce_checks
from .test_embedding import embedding_checks
from .test_linear import linear_checks
from .test_mappings import mapping_checks
from .test_mlp import lm_checks, mlp_checks
from .test_training import check_dropout_results, clip_checks, dropout_checks


def all_checks() -> dict:
    """Every check on this rank: fp32 layer checks, fp64 block/training checks, and the dropout masks."""
    assert tpkit.get_communicator().backend == "torch"
    fp32 = {**linear_checks("float32"), **embedding_checks("float32"), **conv_checks("float32")}
    fp64 = {**mlp_checks(), **lm_checks(), **ce_checks(), **clip_checks(), **mapping_checks((3, 7, 2), 1)}
    return {"fp32": fp32, "fp64": fp64, "bf16": ce_bf16_checks(), "dropout": dropout_checks(True)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_everything_on_gloo_processes(world_size):
    results = run(all_checks, world_size, "gloo")
    assert_small([r["fp32"] for r in results], FP32_TOL)
    assert_small([r["fp64"] for r in results], FP64_TOL)
    for r in results:
        assert r["bf16"]["bf16 loss"] < 1e-5 and r["bf16"]["bf16 dlogits"] < 2 ** -8
    check_dropout_results([r["dropout"] for r in results], processes=True)
