"""AlgorithmSelector: MPICH thresholds before calibration, fastest predicted (with margin) after."""
from __future__ import annotations

import re
import time

import pytest
import torch

from tpkit.comm import ALGORITHMS, AlgorithmCommunicator, AlgorithmSelector, CostModel, run_threads
from tpkit.comm.selector import mpich_choice


@pytest.mark.parametrize("collective, nbytes, p, expected", [
    ("all_reduce", 2047, 4, "recursive_doubling"),
    ("all_reduce", 2048, 4, "rabenseifner"),
    ("all_reduce", 1 << 26, 3, "rabenseifner"),
    ("all_gather", 524287, 4, "recursive_doubling"),  # power of two, below the long-message size
    ("all_gather", 524288, 4, "ring"),
    ("all_gather", 81919, 3, "bruck"),  # not a power of two, short
    ("all_gather", 81920, 3, "ring"),
    ("reduce_scatter", 524287, 3, "recursive_halving"),
    ("reduce_scatter", 524288, 3, "pairwise"),
    ("broadcast", 12287, 8, "binomial"),
    ("broadcast", 12288, 8, "scatter_allgather"),
    ("broadcast", 1 << 26, 7, "binomial"),  # fewer than 8 processes: always the tree
    ("all_to_all", 4 * 32768 - 1, 4, "direct"),  # pieces below MPICH's medium size: all in flight at once
    ("all_to_all", 4 * 32768, 4, "pairwise"),
])
def test_uncalibrated_selector_uses_mpich_thresholds(collective, nbytes, p, expected):
    assert mpich_choice(collective, nbytes, p) == expected
    assert AlgorithmSelector().select(collective, nbytes, p) == expected


def test_all_reduce_with_fewer_elements_than_ranks_uses_recursive_doubling():
    # 4096 bytes of 1 KiB elements = 4 elements on 8 ranks: too few to split, MPICH keeps recursive doubling
    assert mpich_choice("all_reduce", 4096, 8, itemsize=1024) == "recursive_doubling"
    assert mpich_choice("all_reduce", 4096, 8, itemsize=4) == "rabenseifner"


def test_single_rank_and_bad_input():
    assert AlgorithmSelector().select("all_reduce", 1 << 20, 1) == "builtin"
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        AlgorithmSelector().select("gather", 10, 2)
    with pytest.raises(ValueError, match="margin must be in"):
        AlgorithmSelector(margin=1.5)


def _model(**builtin) -> CostModel:
    model = CostModel(alpha=100e-6, beta=1e-9, gamma=1e-9, calibrated=True)
    model.measured.update({(c, "builtin", 4): [(0, a), (1 << 30, a + b * (1 << 30))] for c, (a, b) in builtin.items()})
    return model


def test_calibrated_selector_picks_the_fastest_prediction_with_a_margin_for_builtin():
    m = 1 << 20
    # builtin all_reduce: 50 us + 1 ns/B -- far faster than any send/recv algorithm -> builtin
    sel = AlgorithmSelector(_model(all_reduce=(50e-6, 1e-9)))
    assert sel.select("all_reduce", m, 4) == "builtin"
    # builtin reduce_scatter costs an all-reduce (2x the bytes): direct (1 alpha + 2 ns/B * 0.75 MiB) wins
    sel = AlgorithmSelector(_model(reduce_scatter=(300e-6, 4e-9)))
    best = sel.select("reduce_scatter", m, 4)
    assert best == "direct"
    ranked = dict(sel.ranked("reduce_scatter", m, 4))
    assert ranked[best] == pytest.approx(min(v for k, v in ranked.items() if k != "builtin"))
    # margin: an algorithm predicted 10% faster than builtin is not worth it, 30% faster is
    fastest = min(_model().predict("all_gather", alg, m, 4) for alg in ("ring", "bruck", "recursive_doubling", "direct"))
    assert AlgorithmSelector(_model(all_gather=(fastest / 0.9, 0.0))).select("all_gather", m, 4) == "builtin"
    assert AlgorithmSelector(_model(all_gather=(fastest / 0.7, 0.0))).select("all_gather", m, 4) != "builtin"


def test_decisions_are_cached_until_the_model_is_refit():
    sel = AlgorithmSelector()
    assert sel.select("all_reduce", 1 << 20, 4) == "rabenseifner"
    samples = [("all_reduce", alg, nb, 4, t) for nb in (4096, 1 << 20) for alg, t in
               (("ring", 1.0), ("rabenseifner", 1.0), ("recursive_doubling", 1.0), ("tree", 1.0))]
    samples += [("all_reduce", "builtin", nb, 4, 1e-4) for nb in (4096, 1 << 20)]
    sel.model.fit(samples)
    assert sel.select("all_reduce", 1 << 20, 4) == "builtin"


def test_auto_communicator_runs_the_selected_algorithm_on_every_rank():
    def body(comm):
        auto = AlgorithmCommunicator(comm, "auto", verify=0)
        small, large = torch.ones(100), torch.ones(300_000)
        out = []
        for t in (small, large):
            auto.reduce_scatter(t)
            out.append(auto.last_algorithm)
            auto.all_gather(t)
            out.append(auto.last_algorithm)
        return out

    results = run_threads(body, 3)
    assert results[0] == ["recursive_halving", "bruck", "pairwise", "ring"]
    assert all(r == results[0] for r in results)


def _slow(fn, seconds):
    def run(*args):
        time.sleep(seconds)
        return fn(*args)
    return run


@pytest.mark.parametrize("slow_down, expected", [(0.03, "builtin"), (0.0, None)])
def test_auto_verifies_the_prediction_and_every_rank_keeps_the_same_choice(monkeypatch, slow_down, expected):
    ring = ALGORITHMS["all_reduce"]["ring"]
    monkeypatch.setitem(ALGORITHMS["all_reduce"], "ring", _slow(ring, slow_down))
    model = CostModel(calibrated=True)
    model.measured[("all_reduce", "builtin", 3)] = [(0, 1.0), (1 << 30, 2.0)]  # builtin predicted very slow
    model.measured[("all_reduce", "ring", 3)] = [(0, 1e-6), (1 << 30, 1e-6)]  # ring predicted very fast

    def body(comm):
        auto = AlgorithmCommunicator(comm, "auto", AlgorithmSelector(model), verify=3)
        x = torch.arange(6.0) * (comm.rank + 1)
        trail = []
        for _ in range(8):
            out = auto.all_reduce(x)
            assert torch.equal(out, torch.arange(6.0) * 6)
            trail.append((auto.last_algorithm, auto.last_note))
        return trail

    trails = run_threads(body, 3)
    algs = [[a for a, _ in tr] for tr in trails]
    assert all(a == algs[0] for a in algs)  # every rank ran the same algorithm at every call
    assert algs[0][:6] == ["builtin", "ring"] * 3 and "verifying ring" in trails[0][0][1]
    final, note = algs[0][6], trails[0][6][1]
    assert final == algs[0][7] and ("kept builtin" if final == "builtin" else "verified") in note
    if expected:
        assert final == expected, note
    else:  # nothing slowed down: which is faster is the machine's call, but the choice must follow the measurement
        ratio = float(re.search(r"(\d+\.\d+)x builtin", note).group(1))  # builtin time / ring time, 2 decimals
        if ratio >= 1.06:  # ring clearly more than verify_margin (5%) faster
            assert final == "ring", note
        elif ratio <= 1.04:
            assert final == "builtin", note
