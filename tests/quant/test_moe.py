"""Quantized MoE experts (issue 47 item 3): Mixtral and Qwen3-MoE checkpoints whose experts are stored one quantized
linear layer per expert projection (compressed-tensors int4 group 128 and int8 per channel as llm-compressor writes
them; FP8 blocks as DeepSeek-V3 / Qwen3-30B-A3B-FP8 do) load split like dense experts, inside every expert
(`experts_tp`, the default) or across ranks (`experts_ep`), at 1, 2 and 3 thread-ranks, and equal transformers' load
of the directory (`CompressedTensorsConfig` / `FineGrainedFP8Config(dequantize=True)`, which stacks the dequantized
experts): logits float32 rel 1e-5, every local expert's dequantized weights the exact slice of the reference's; each
rank holds its slice of the stacked stored tensors only. `dequantize=True` gives dense experts with those weights."""
from __future__ import annotations

import pytest
import torch

import tpkit
from tpkit.comm import run_threads
from tpkit.nn.quantized_experts import experts_methods_of
from tests.quant import checkpoints as C

pytest.importorskip("compressed_tensors")

EP = {"model.layers.*.mlp.experts": "experts_ep"}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized-moe")
    bases = {"mixtral": C.mixtral(), "qwen3_moe": C.qwen3_moe()}
    out = {}

    def get(name: str):
        if name not in out:
            model, maker = C.MOE_FORMATS[name]
            directory = maker(str(root / name), bases[model])
            ref = C.reference(directory)
            with torch.no_grad():
                out[name] = (directory, ref.state_dict(), ref(C.IDS).logits)
        return out[name]

    return get


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _check(directory: str, dense: dict, want: torch.Tensor, world: int, plan) -> list[str]:
    def body(comm):
        model = tpkit.from_pretrained(directory, comm=comm, progress=False, plan=plan)
        bad, held = [], 0
        for name, m in model.named_modules():
            for param, method in experts_methods_of(m).items():
                held += 1
                key = f"{name}.{param}"
                got, ref = getattr(m, param), method.dense.shard(dense[key])
                if not torch.equal(got, ref):
                    bad.append(f"rank {comm.rank} {key}: dequantized experts differ by {(got - ref).abs().max():.3g}")
                for s, lay in method.layouts.items():
                    t = m._modules[param]._buffers[s]
                    if tuple(t.shape) != lay.local_shape:
                        bad.append(f"rank {comm.rank} {key}.{s}: holds {list(t.shape)}, its slice is {lay.local_shape}")
        if held == 0:
            bad.append(f"rank {comm.rank}: no experts were loaded quantized")
        with torch.no_grad():
            err = _rel(model(C.IDS).logits, want)
        if not err < 1e-5:
            bad.append(f"rank {comm.rank}: logits rel {err:.2e}")
        return bad

    return [b for r in run_threads(body, world) for b in r]


@pytest.mark.parametrize("world,plan", [(1, "auto"), (2, "auto"), (3, "auto"), (2, EP), (3, EP)],
                         ids=["1", "2-tp", "3-tp", "2-ep", "3-ep"])
@pytest.mark.parametrize("fmt", sorted(C.MOE_FORMATS))
def test_quantized_experts_split_like_dense_ones_and_equal_transformers(made, fmt, world, plan):
    directory, dense, want = made(fmt)
    bad = _check(directory, dense, want, world, plan)
    assert not bad, f"{fmt} at {world} ranks:\n" + "\n".join(bad[:8])


def test_dequantize_loads_dense_experts(made):
    directory, dense, want = made("qwen3-moe-int4")

    def body(comm):
        model = tpkit.from_pretrained(directory, comm=comm, progress=False, dequantize=True)
        experts = model.model.layers[0].mlp.experts
        key = "model.layers.0.mlp.experts.gate_up_proj"
        assert not experts_methods_of(experts) and isinstance(experts.gate_up_proj, torch.nn.Parameter)
        assert torch.equal(experts.gate_up_proj, tpkit.shard_layouts(model)[key].shard(dense[key]))  # (dense: a key)
        with torch.no_grad():
            return _rel(model(C.IDS).logits, want)

    assert max(run_threads(body, 2)) < 1e-5
