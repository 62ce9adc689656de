"""What stays whole, and why, is said once per conversion on the `tpkit.convert` logger, and
`Plan.kept_whole()` / `repr(plan)` show it (issue 20 item 5)."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import tpkit  # noqa: E402
from tpkit.convert import parallelize, plan, quiet_conversions  # noqa: E402

from tests.models.hf import hf_model  # noqa: E402

HEADS = "model.layers.*.self_attn: 2 query heads cannot be split over 3 ranks"


def _convert(model, world, plan_arg="auto"):
    copies = [copy.deepcopy(model) for _ in range(world)]
    return tpkit.comm.run_threads(lambda comm: parallelize(copies[comm.rank], plan_arg, comm).tp_plan, world)


def _records(caplog):
    return [r for r in caplog.records if r.name.startswith("tpkit")]


@pytest.fixture(scope="module")
def llama():
    return hf_model("llama", num_attention_heads=2, num_key_value_heads=2)  # 2 heads: not over 3 ranks


def test_auto_plan_with_heads_that_do_not_divide_warns_once_with_counted_reasons(llama, caplog):
    caplog.set_level(logging.INFO, logger="tpkit")
    plans = _convert(llama, 3)
    records = _records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]  # once per conversion, not once per rank
    rec = records[0]
    assert rec.levelno == logging.WARNING and rec.name == "tpkit.convert"
    # the projections cannot be split by heads: each is split alone, its output gathered (an all-gather per call)
    assert "8 modules split alone (output all-gathered): 8 x " + HEADS in rec.getMessage()
    alone = plans[0].split_alone()
    assert sorted(alone) == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkvo")
    assert not plans[0].kept_whole()  # norms stay whole by design, and are not counted
    assert "model.norm" in plans[0].reasons and "8 modules split alone" in repr(plans[0])


def test_a_given_plan_logs_at_info_and_quiet_conversions_silences(llama, caplog):
    caplog.set_level(logging.INFO, logger="tpkit")
    given = plan(llama, 3)
    _convert(llama, 3, given)
    assert [r.levelno for r in _records(caplog)] == [logging.INFO]
    caplog.clear()
    with quiet_conversions():
        with quiet_conversions():  # blocks nest
            pass
        _convert(llama, 3)  # thread-ranks are quiet too
    assert _records(caplog) == []
    _convert(llama, 3)  # and the block's end restores the line
    assert [r.levelno for r in _records(caplog)] == [logging.WARNING]


def test_nothing_is_logged_when_only_small_layers_stay_whole(caplog):
    caplog.set_level(logging.INFO, logger="tpkit")
    model = hf_model("gpt2")  # norms and the position table stay whole, by design
    plans = _convert(model, 2)
    assert _records(caplog) == [] and plans[0].kept_whole() == {}
    assert "transformer.wpe" in plans[0].reasons and "kept whole" not in repr(plans[0])


class _NeedsAKeyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, *, scale):
        return self.down(torch.relu(self.up(x))) * scale


def test_an_untraceable_forward_is_reported(caplog):
    caplog.set_level(logging.INFO, logger="tpkit")
    model = _NeedsAKeyword()
    plans = _convert(model, 2)
    (rec,) = _records(caplog)
    assert rec.levelno == logging.WARNING and "2 modules kept whole: 2 x the model's forward could not be traced" \
        in rec.getMessage()
    assert set(plans[0].kept_whole()) == {"up", "down"}
