"""CostModel: the alpha-beta-gamma formulas against hand-computed values, the fit, and calibration."""
from __future__ import annotations

import pytest
import torch

from tpkit.comm import ALGORITHMS, CostModel, run_threads
from tpkit.comm.cost_model import coefficients

M = 1 << 20  # 1 MiB
MODEL = CostModel(alpha=1e-5, beta=1e-9, gamma=5e-10)


@pytest.mark.parametrize("collective, algorithm, p, expected", [
    # (collective, algorithm, world size, (alpha count, beta bytes, gamma bytes)), worked out by hand
    ("all_reduce", "ring", 4, (6, 1.5 * M, 0.75 * M)),
    ("all_reduce", "recursive_doubling", 4, (2, 2 * M, 2 * M)),
    ("all_reduce", "recursive_doubling", 3, (1 + 2, 1 * M + 2 * M, 1 * M + M)),  # p2 = 2, plus the fold
    ("all_reduce", "rabenseifner", 4, (4, 1.5 * M, 0.75 * M)),
    ("all_reduce", "rabenseifner", 6, (4 + 2, 1.5 * M + 2 * M, 0.75 * M + M)),  # p2 = 4
    ("all_reduce", "tree", 5, (6, 6 * M, 3 * M)),  # ceil(log2 5) = 3
    ("all_gather", "ring", 4, (3, 0.75 * M, 0)),
    ("all_gather", "bruck", 5, (3, 0.8 * M, 0)),
    ("all_gather", "recursive_doubling", 8, (3, 0.875 * M, 0)),
    ("all_gather", "recursive_doubling", 3, (1 + 2, 0.5 * M + M / 3 + M, 0)),
    ("reduce_scatter", "ring", 4, (3, 0.75 * M, 0.75 * M)),
    ("reduce_scatter", "pairwise", 3, (2, 2 / 3 * M, 2 / 3 * M)),
    ("reduce_scatter", "recursive_halving", 4, (2, 0.75 * M, 0.75 * M)),
    ("reduce_scatter", "recursive_halving", 5, (2 + 2, 0.75 * M + M + 0.2 * M, 0.75 * M + M)),
    ("broadcast", "binomial", 4, (2, 2 * M, 0)),
    ("broadcast", "scatter_allgather", 4, (5, 1.5 * M, 0)),
    ("all_reduce", "direct", 4, (2, 1.5 * M, 0.75 * M)),  # two rounds, every message of a round at once
    ("all_gather", "direct", 4, (1, 0.75 * M, 0)),
    ("reduce_scatter", "direct", 5, (1, 0.8 * M, 0.8 * M)),
    ("all_reduce", "ring", 1, (0, 0, 0)),
])
def test_coefficients_match_hand_computed_values(collective, algorithm, p, expected):
    assert coefficients(collective, algorithm, M, p) == pytest.approx(expected)


def test_predict_is_the_weighted_sum_and_builtin_uses_its_fitted_line():
    # ring all_reduce on 4 ranks: 6 alpha + 1.5 MiB beta + 0.75 MiB gamma
    assert MODEL.predict("all_reduce", "ring", M, 4) == pytest.approx(6e-5 + 1.5 * M * 1e-9 + 0.75 * M * 5e-10)
    assert MODEL.predict("broadcast", "binomial", 1000, 8) == pytest.approx(3e-5 + 3000e-9)
    assert MODEL.predict("all_reduce", "ring", M, 1) == 0.0
    # uncalibrated builtin reduce_scatter = a ring all-reduce plus the copy out
    assert MODEL.predict("reduce_scatter", "builtin", M, 4) == pytest.approx(
        MODEL.predict("all_reduce", "ring", M, 4) + 0.75 * M * 5e-10)
    model = CostModel(alpha=1e-5, beta=1e-9, gamma=5e-10,
                      measured={("all_reduce", "builtin", 4): [(M, 1e-3), (4 * M, 4e-3), (16 * M, 10e-3)]})
    # measured curve: flat below the first size, linear between sizes, last slope beyond the last
    assert model.predict("all_reduce", "builtin", 1000, 4) == pytest.approx(1e-3)
    assert model.predict("all_reduce", "builtin", 2 * M, 4) == pytest.approx(2e-3)
    assert model.predict("all_reduce", "builtin", 10 * M, 4) == pytest.approx(7e-3)
    assert model.predict("all_reduce", "builtin", 28 * M, 4) == pytest.approx(16e-3)
    assert model.predict("all_reduce", "ring", M, 4) == pytest.approx(MODEL.predict("all_reduce", "ring", M, 4))
    assert model.predict("all_reduce", "ring", M, 3) == pytest.approx(MODEL.predict("all_reduce", "ring", M, 3))
    assert CostModel.from_dict(model.to_dict()) == model
    assert model.predict("all_reduce", "builtin", M, 2) == pytest.approx(MODEL.predict("all_reduce", "ring", M, 2))
    with pytest.raises(ValueError, match="unknown collective 'alltoall'"):
        MODEL.predict("alltoall", "ring", M, 4)
    with pytest.raises(ValueError, match="no formula for collective 'all_gather' with algorithm 'pairwise'"):
        MODEL.predict("all_gather", "pairwise", M, 4)
    with pytest.raises(ValueError, match="world_size >= 1"):
        MODEL.predict("all_reduce", "ring", M, 0)


def test_fit_recovers_known_parameters_and_stays_non_negative():
    truth = CostModel(alpha=3e-5, beta=2e-9, gamma=4e-10)
    samples = []
    for col in ALGORITHMS:
        for alg in ALGORITHMS[col]:
            for nbytes in (4096, 65536, M, 16 * M):
                for p in (3, 4):
                    samples.append((col, alg, nbytes, p, truth.predict(col, alg, nbytes, p)))
    samples += [("all_reduce", "builtin", nb, 4, 1e-4 + 5e-9 * nb) for nb in (4096, M, 16 * M)]
    fitted = CostModel().fit(samples)
    assert fitted.calibrated and fitted.version == 1
    assert (fitted.alpha, fitted.beta, fitted.gamma) == pytest.approx((3e-5, 2e-9, 4e-10), rel=1e-6)
    assert fitted.measured[("all_reduce", "builtin", 4)] == [(nb, 1e-4 + 5e-9 * nb) for nb in (4096, M, 16 * M)]
    assert fitted.predict("all_reduce", "builtin", 8 * M, 4) == pytest.approx(1e-4 + 5e-9 * 8 * M)
    assert fitted.formula("all_gather", "ring", M, 5) == pytest.approx(truth.predict("all_gather", "ring", M, 5))
    # data that a negative gamma would fit better: gamma is clamped to 0 and the rest refit
    skewed = [("all_gather", "ring", nb, 4, truth.predict("all_gather", "ring", nb, 4)) for nb in (4096, M)]
    skewed += [("reduce_scatter", "ring", nb, 4, 0.5 * truth.predict("all_gather", "ring", nb, 4)) for nb in (4096, M)]
    fitted = CostModel().fit(skewed)
    assert fitted.gamma == 0.0 and fitted.alpha > 0 and fitted.beta > 0


def test_calibrate_on_threads_gives_every_rank_the_same_model():
    def body(comm):
        model = CostModel().calibrate(comm, sizes=(4096, 65536), iters=1)
        return model.to_dict()

    models = run_threads(body, 3)
    assert all(m == models[0] for m in models)
    m = models[0]
    assert m["calibrated"] and m["alpha"] >= 0 and m["beta"] >= 0 and m["gamma"] >= 0 and m["alpha"] + m["beta"] > 0
    assert {"all_reduce/builtin@3", "all_gather/builtin@3", "reduce_scatter/builtin@3", "broadcast/builtin@3",
            "reduce_scatter/direct@3", "all_reduce/rabenseifner@3"} <= set(m["measured"])
    single = run_threads(lambda comm: CostModel().calibrate(comm).calibrated, 1)
    assert single == [True]
