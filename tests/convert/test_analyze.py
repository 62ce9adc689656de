"""`analyze`: the figures equal hand-computed ones and the bytes `parallelize` really leaves on each rank."""
from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("transformers")

import tpkit  # noqa: E402
from tpkit.convert import analyze, parallelize  # noqa: E402
from tpkit.convert.advice.analyze import parse_bytes  # noqa: E402

from tests.models.hf import VOCAB, hf_model  # noqa: E402
from tests.models.custom import mlp  # noqa: E402
from .rendered import check_summary, expected_rows  # noqa: E402

H, I, L, NH, NKV = 64, 80, 2, 8, 4
HD = H // NH


def _by_hand(world: int) -> tuple[int, int]:
    """(total parameters, parameters on rank 0) of the tiny Llama, counted by hand."""
    def share(n):  # rank 0's share under the split rule (first ranks take the remainder)
        return -(-n // world)
    layer = H * H + 2 * H * NKV * HD + H * H + 3 * H * I + 2 * H
    total = 2 * VOCAB * H + L * layer + H
    layer_r0 = (share(NH) * HD * H + 2 * share(NKV) * HD * H + H * share(NH) * HD + 3 * H * share(I) + 2 * H)
    rank0 = 2 * share(VOCAB) * H + L * layer_r0 + H
    return total, rank0


def test_figures_equal_hand_computed_ones():
    model = hf_model("llama")
    report = analyze(model, world_size=2, max_world_size=4, device_memory="1GB")
    total, _ = _by_hand(1)
    assert report.total_params == total and report.total_bytes == 4 * total
    for w in (1, 2, 4):
        assert report.per_rank_bytes[w] == 4 * _by_hand(w)[1], w
    norms = (2 * L + 1) * H
    assert report.parallelizable_bytes == 4 * (total - norms)
    assert abs(report.parallelizable_percent - 100 * (total - norms) / total) < 1e-9
    rows = {r.name: r for r in report.layers}
    q = rows["model.layers.0.self_attn.q_proj"]
    assert (q.type, q.shape, q.params, q.bytes, q.style, q.bytes_per_rank) == ("Linear", (H, H), H * H, 4 * H * H,
                                                                                "colwise", 2 * H * H)
    assert rows["model.norm"].style == "replicate" and "whole vector" in rows["model.norm"].reason
    assert report.suggested_world_size == 1
    json.dumps(report.to_dict())
    text = report.summary()
    assert "model.layers.*.mlp.down_proj (x2)" in text and "rowwise" in text and "suggested world size: 1" in text


@pytest.mark.parametrize("heads,kv_heads,worlds", [(8, 2, (2, 3, 4)), (12, 4, (5,))])
def test_parameter_bytes_per_rank_equal_bytes_after_parallelize(heads, kv_heads, worlds):
    """(12 query / 4 KV heads at 5 ranks: the general layout, where rank 3 holds two KV heads.)"""
    model = hf_model("llama", hidden_size=4 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads)
    for world in worlds:
        report = analyze(model, world_size=world, max_world_size=world, device_memory="1GB")
        copies = [copy.deepcopy(model) for _ in range(world)]

        def body(comm):
            m = parallelize(copies[comm.rank], "auto", comm)
            return sum(p.numel() * p.element_size() for p in m.parameters())
        held = tpkit.comm.run_threads(body, world)
        assert report.per_rank_bytes[world] == max(held), (world, report.per_rank_bytes[world], held)


def test_suggestion_training_mode_and_recommendations():
    model = hf_model("llama", num_key_value_heads=2)
    inference = analyze(model, max_world_size=4, device_memory=None)
    if not torch.cuda.is_available():  # no GPU and no budget given: this host's memory, said so (issue 20 item 10)
        assert inference.suggested_world_size == 1 and "host memory" in inference.suggestion
        assert "no GPU detected and no device_memory given" in inference.suggestion and "given" not in \
            inference.suggestion.split("(")[0]
    fits_two = (inference.per_rank_bytes[2] + inference.per_rank_bytes[1]) // 2
    assert analyze(model, max_world_size=4, device_memory=fits_two).suggested_world_size == 2
    training = analyze(model, world_size=4, max_world_size=4, device_memory="1GB", mode="training")
    for w, b in training.per_rank_bytes.items():
        assert training.per_rank_memory[w] == 2 * b + (b // 4) * 8  # weights + grads (fp32) + AdamW (2 x fp32)
    text = " ".join(training.recommendations)
    assert "2 KV heads < world size 4" in text and "vocabulary 103 does not divide by 4" in text
    assert "sequence_parallel=True) would split the residual stream and its 5 norms" in text
    assert training.plan["lm_head"] == "vocab_parallel"
    too_small = analyze(model, max_world_size=4, device_memory=1000)
    assert too_small.suggested_world_size is None and "no world size up to 4 fits" in too_small.suggestion


def test_untraceable_model_is_replicated_with_the_reason():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

        def forward(self, x, needed):
            return self.b(torch.relu(self.a(x))) * needed

    report = analyze(Odd(), world_size=2, device_memory="1GB")
    assert report.parallelizable_bytes == 0 and "could not be traced" in report.layers[0].reason
    ok = analyze(Odd(), world_size=2, device_memory="1GB", example_inputs=(torch.randn(2, 4), 2.0))
    assert [r.style for r in ok.layers] == ["colwise", "rowwise"]


def test_parse_bytes_and_plain_mlp():
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes(5) == 5 and parse_bytes("1.5e9") == 1_500_000_000
    # GPU memory is sold in binary units under decimal names: an "80GB" H100 holds 80 GiB.
    for text, size in (("80GB", 80 * 2**30), ("80 gb", 80 * 2**30), ("80G", 80 * 2**30), ("16MB", 16 * 2**20),
                       ("512MiB", 512 * 2**20), ("2TB", 2 * 2**40), ("2TiB", 2 * 2**40), ("4KB", 4096), ("7B", 7)):
        assert parse_bytes(text) == size, text
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")
    report = analyze(mlp(), world_size=2, device_memory="1MB")
    # the last layer has no partner: split alone, its output gathered (it holds over 1/8 of the largest layer)
    assert [r.style for r in report.layers] == ["colwise", "rowwise", "colwise_rep"]
    assert "split alone" in report.layers[2].reason


def test_summary_at_80_columns_and_unlimited():
    """Readable piped (nothing wraps) and at 80 or 60 columns (columns left out, reasons wrapped between words,
    names broken after a dot): no cell is cut inside a word or a number."""
    report = analyze(hf_model("bert"), world_size=2, max_world_size=4, device_memory="1GB", mode="training")
    wide = report.summary()
    assert check_summary(wide, report, None) == ["layer", "type", "weight", "params", "bytes", "per rank @2",
                                                  "style / reason"]
    for label, nbytes, how in expected_rows(report):  # unlimited: each row whole on one line
        assert any(label in line and nbytes in line and how in line for line in wide.splitlines()), label
    for rec in report.recommendations:
        assert f"  - {rec}" in wide.splitlines()
    for width in (80, 60):
        text = report.summary(width=width)
        headers = check_summary(text, report, width)
        assert headers[0] == "layer" and headers[-2:] == ["per rank @2", "style / reason"]
        left_out = [h for h in ("type", "weight", "params", "bytes") if h not in headers]
        assert left_out and f"left out to fit {width} columns: {', '.join(left_out)}" in " ".join(text.split())
        assert " ".join(text.split()).count(report.recommendations[0]) == 1  # prose wraps between words
