"""A fixed sample of the zoo sweep (issue 24), run by the sweep's own code (`bench/sweep_run.py`): each
architecture's outcome and per-rank share at 2 ranks are what `bench/results/zoo_sweep.csv` records, and no
sampled architecture crashes or computes a wrong result. The sample spreads over the outcomes and the patterns
the sweep found (an untraced cross-attention, a layer shared across depth, a vision tower given no image, an
embedding scaled by a number, a large position table, experts, images, references that are not finite)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "bench"
SAMPLE = (  # (model_type, class)
    ("llama", "LlamaForCausalLM"), ("gpt2", "GPT2LMHeadModel"), ("bert", "BertForMaskedLM"),
    ("t5", "T5ForConditionalGeneration"), ("bart", "BartForCausalLM"), ("bart", "BartForConditionalGeneration"),
    ("bart", "BartForSequenceClassification"), ("vit", "ViTForImageClassification"),
    ("beit", "BeitForImageClassification"), ("albert", "AlbertForMaskedLM"),
    ("mixtral", "MixtralForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM"), ("codegen", "CodeGenForCausalLM"),
    ("falcon", "FalconForCausalLM"), ("opt", "OPTForCausalLM"), ("distilbert", "DistilBertForSequenceClassification"),
    ("mobilenet_v1", "MobileNetV1ForImageClassification"), ("longformer", "LongformerForMaskedLM"),
    ("canine", "CanineForSequenceClassification"), ("layoutlm", "LayoutLMForMaskedLM"),
    ("gemma3", "Gemma3ForConditionalGeneration"),
)


def _rows() -> dict:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import sweep_report

    return {(r["model_type"], r["cls"]): r for r in sweep_report.read()}


@pytest.mark.parametrize("model_type,cls", SAMPLE)
def test_a_sampled_architecture_does_what_the_sweep_recorded(model_type, cls):
    rows = _rows()
    if (model_type, cls) not in rows:
        pytest.skip(f"{model_type}/{cls} is not in bench/results/zoo_sweep.csv (not in this transformers)")
    import sweep_run

    want = rows[model_type, cls]
    got = sweep_run.run_one(want["task"], model_type, cls)
    assert got["outcome"] not in ("crashed", "wrong"), got["detail"]
    assert got["outcome"] == want["outcome"], (got["detail"], want["detail"])
    if want["share2"]:
        assert abs(float(got["share2"]) - float(want["share2"])) < 5e-3


def test_the_coverage_page_block_is_the_csvs_summary():
    _rows()
    import sweep_report

    text = sweep_report.PAGE.read_text()
    block = text.split(sweep_report.BEGIN, 1)[1].split(sweep_report.END, 1)[0].strip()
    assert block == sweep_report.table(sweep_report.read()), "run python bench/zoo_sweep.py --report --page"
    counts = sweep_report.summary(sweep_report.read())["counts"]
    assert counts["crashed"] == counts["wrong"] == 0
