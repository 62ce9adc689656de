"""A search's measured setups (`estimate/measured.py`): each of the top K runs in several launches taking turns,
ranked by the median, and setups whose launches overlap the best's are a tie the search names."""
from __future__ import annotations

import pytest
import torch
import transformers as tr

from tpkit.estimate.measured import inseparable, run_alternating, runs_text
from tpkit.estimate.search import search as rank_setups

from ..conftest import synthetic_profile


def _config() -> tr.LlamaConfig:
    return tr.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)


def test_launches_take_turns_in_an_order_reversed_every_round():
    order = []
    runs = run_alternating(3, 3, lambda i: order.append(i) or float(i))
    assert order == [0, 1, 2, 2, 1, 0, 0, 1, 2]
    assert runs == [(0.0,) * 3, (1.0,) * 3, (2.0,) * 3]
    with pytest.raises(ValueError, match="launches must be >= 1"):
        run_alternating(2, 0, float)


def test_what_the_launches_cannot_separate():
    assert inseparable((0.010, 0.012, 0.011), (0.0115, 0.013, 0.014), 0.05)  # ranges overlap
    assert not inseparable((0.010, 0.012, 0.011), (0.0125, 0.013, 0.014), 0.05)  # every launch slower
    assert inseparable((0.010,), (0.0104,), 0.05) and not inseparable((0.010,), (0.011,), 0.05)  # one launch: NOISE
    assert runs_text((0.010, 0.012, 0.011)) == "11.00 (10.00-12.00)" and runs_text((0.01,)) == "10.00"


def _ranked(times: dict[int, list[float]], launches: int):
    """`rank_setups` measuring the top 2 with a runner that gives the k-th setup run the times of `times[k]` in
    turn (the runner sees setups in the order the search runs them)."""
    seen: list = []
    calls: dict = {}

    def runner(model, setup, goal, batch, seq):
        if setup not in seen:
            seen.append(setup)
        k = seen.index(setup)
        calls[k] = calls.get(k, 0) + 1
        return times[k][calls[k] - 1]

    return rank_setups(_config(), 2, "train", batch_size=2, seq_len=16, profile=synthetic_profile(), measure=2,
                       runner=runner, dtype=torch.float32, launches=launches)


def test_the_median_ranks_and_overlapping_launches_are_a_tie():
    separate = _ranked({0: [0.030, 0.031, 0.029], 1: [0.020, 0.021, 0.022]}, 3)
    best, second = separate.candidates[:2]
    assert best.measured_runs == (0.020, 0.021, 0.022) and best.measured_s == 0.021 and second.measured_s == 0.030
    assert not separate.tied and "a tie" not in separate.explain()
    assert "the median of 3 launches each" in separate.explain() and "21.00 (20.00-22.00)" in separate.table
    assert separate.to_dict()["candidates"][0]["measured_runs"] == [0.020, 0.021, 0.022]
    overlap = _ranked({0: [0.020, 0.026, 0.021], 1: [0.022, 0.023, 0.024]}, 3)
    assert overlap.best.measured_s == 0.021 and [c.setup for c in overlap.tied] == [overlap.candidates[1].setup]
    assert "the launches cannot separate them" in overlap.explain() and overlap.to_dict()["tied"]


def test_one_launch_keeps_the_estimates_tie_rule():
    one = _ranked({0: [0.0200], 1: [0.0205]}, 1)
    assert len(one.tied) == 1 and "within 5% of the best" in one.explain()
