"""AlgorithmSelector: MPICH thresholds before calibration, fastest predicted (with margin) after."""
from __future__ import annotations

import pytest
import torch

from tpkit.comm import AlgorithmCommunicator, AlgorithmSelector, CostModel, run_threads
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
        auto = AlgorithmCommunicator(comm, "auto")
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
