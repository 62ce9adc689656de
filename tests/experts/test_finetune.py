"""examples/finetune.py --ep on gloo processes (its `main()` under `tpkit.launch`; the ep4 over tp2 x dp2 run under
real torchrun), float64, on a Qwen3-MoE with fused experts (6
experts, top-2): the directory --consolidate writes equals ONE process of plain transformers + torch doing the
example's documented steps on the whole global batch (its batch rule, `model(input_ids=x, labels=x).loss`,
backward, `clip_grad_norm_`, AdamW; transformers' eager experts, its fused kernel having no float64), and the printed
loss and gradient norm equal that process's to their 4 printed decimals: ep2 over dp2, ep2 = tp2, ep4 over tp2 x dp2
whose checkpoint resumes at tp2 alone (float64 TP of the fused experts), ep4 over dp4 (6 experts: 2, 2, 1, 1),
ep4 over cp2 x dp2 (FSDP2 over dp x cp, the experts reduced over their own group), DDP, and an ep that cannot be
carved from the world, refused before step 1."""
from __future__ import annotations

import os

import pytest
import torch

from tests.context.test_finetune import _printed, _reference, _run

STEPS, LR = 3, "1e-3"


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    import transformers as tr

    root = tmp_path_factory.mktemp("ep_models")
    torch.manual_seed(0)
    config = tr.Qwen3MoeConfig(vocab_size=103, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               num_experts=6, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                               max_position_embeddings=64, norm_topk_prob=True, initializer_range=0.2)
    tr.AutoModelForCausalLM.from_config(config).save_pretrained(root / "qwen3moe")
    return str(root / "qwen3moe")


def reference(model_dir: str, seq: int, global_batch: int, steps: int = STEPS):
    """One process of plain transformers (eager experts: its fused kernel has no float64), the example's steps."""
    return _reference(model_dir, seq, global_batch, steps, experts_implementation="eager")


def equal_to_reference(output: str, out_dir: str, want) -> None:
    from safetensors.torch import load_file

    printed, state = want
    assert _printed(output) == printed, (output, printed)
    got = load_file(os.path.join(out_dir, "model.safetensors"))
    assert set(got) == set(state), sorted(set(got) ^ set(state))
    for key, value in state.items():
        err = ((got[key].double() - value).norm() / value.norm()).item()
        assert err < 1e-4, (key, err)


def train(nproc, model_dir, tmp_path, name, *layout, steps=STEPS, resume=False, consolidate=True, seq=12, batch=4,
          under_torchrun=False):
    save, out = str(tmp_path / f"{name}-ckpt"), str(tmp_path / f"{name}-hf")
    args = ["--model", model_dir, *layout, "--dtype", "float64", "--seq", str(seq), "--global-batch", str(batch),
            "--lr", LR, "--steps", str(steps), "--save", save, *(["--consolidate", out] if consolidate else [])]
    return _run(nproc, *args, *(["--resume"] if resume else []), under_torchrun=under_torchrun), out


@pytest.mark.slow
@pytest.mark.parametrize("layout,printed", [
    (("--tp", "1", "--ep", "2"), "world 2 = tp1 x dp2, ep2"),
    (("--tp", "2", "--ep", "2"), "world 2 = tp2 x dp1, ep2"),
], ids=["ep2-over-dp2", "ep2-is-tp2"])
def test_ep2(moe, tmp_path, layout, printed):
    output, out = train(2, moe, tmp_path, "ep2", *layout)
    assert printed in output, output
    equal_to_reference(output, out, reference(moe, 12, 4))


@pytest.mark.slow
@pytest.mark.parametrize("layout,printed", [
    (("--tp", "1", "--ep", "4"), "world 4 = tp1 x dp4, ep4"),  # 6 experts over 4 ranks: 2, 2, 1, 1
    (("--tp", "1", "--cp", "2", "--ep", "4"), "world 4 = tp1 x dp2 x cp2, ep4"),
    (("--tp", "1", "--ep", "2", "--dp-mode", "ddp"), "world 4 = tp1 x dp4, ep2"),
    (("--tp", "1", "--ep", "2", "--dp-mode", "fsdp"), "world 4 = tp1 x dp4, ep2"),  # experts sharded over edp 2
], ids=["ep4-over-dp4", "ep4-over-cp2xdp2", "ep2-over-dp4-ddp", "ep2-over-dp4-fsdp"])
def test_ep_over_four_ranks(moe, tmp_path, layout, printed):
    output, out = train(4, moe, tmp_path, "ep4", *layout)
    assert printed in output, output
    equal_to_reference(output, out, reference(moe, 12, 4))


@pytest.mark.slow
def test_ep4_over_tp2_x_dp2_resumes_at_tp2_alone(moe, tmp_path):
    first, _ = train(4, moe, tmp_path, "ep4tp2", "--tp", "2", "--ep", "4", steps=2, consolidate=False,
                     under_torchrun=True)
    assert "world 4 = tp2 x dp2, ep4" in first, first
    rest, out = train(2, moe, tmp_path, "ep4tp2", "--tp", "2", resume=True)
    printed, state = reference(moe, 12, 4)
    assert _printed(first) == printed[:2] and _printed(rest) == printed[2:], (first, rest, printed)
    equal_to_reference(first + rest, out, (printed, state))


def test_an_ep_that_cannot_be_carved_stops_before_step_one(moe, tmp_path):
    with pytest.raises(RuntimeError) as info:
        _run(2, "--model", moe, "--tp", "2", "--ep", "3", "--steps", "1")
    assert "--ep 3" in str(info.value) and "not a multiple of tp 2" in str(info.value), info.value
    assert "step 1:" not in str(info.value)


@pytest.mark.slow
def test_ep2_x_pp2(moe, tmp_path):
    output, out = train(4, moe, tmp_path, "ep2pp2", "--pp", "2", "--tp", "1", "--ep", "2")
    assert "world 4 = pp2 x dp2 x tp1, ep2" in output, output
    equal_to_reference(output, out, reference(moe, 12, 4))


@pytest.mark.slow
def test_ep2_over_dp2_with_the_auxiliary_loss(tmp_path):
    """The router's load-balancing loss on the whole global batch (one process's), not the mean of the ranks'."""
    import transformers as tr

    torch.manual_seed(2)
    config = tr.Qwen3MoeConfig(vocab_size=103, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               num_experts=6, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                               max_position_embeddings=64, initializer_range=0.2, output_router_logits=True,
                               router_aux_loss_coef=0.5)
    tr.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "aux")
    model_dir = str(tmp_path / "aux")
    output, out = train(2, model_dir, tmp_path, "aux", "--tp", "1", "--ep", "2")
    want = reference(model_dir, 12, 4)
    equal_to_reference(output, out, want)


@pytest.mark.slow
def test_ep2_over_dp4_under_fsdp2_in_float32(moe, tmp_path):
    """FSDP2 over the expert-data group in float32 on gloo (which has no pre-multiplied reduce for FSDP2's own
    divide factor): trains, and its printed figures equal the float64 reference's to float32's precision."""
    output = _run(4, "--model", moe, "--tp", "1", "--ep", "2", "--dtype", "float32", "--seq", "12",
                  "--global-batch", "4", "--lr", LR, "--steps", "2", "--save", str(tmp_path / "f32"))
    got = [(float(loss), float(norm)) for loss, norm in _printed(output)]
    want = [(float(loss), float(norm)) for loss, norm in reference(moe, 12, 4, steps=2)[0]]
    assert len(got) == 2 and all(abs(a - b) <= 2e-4 and abs(c - d) <= 2e-4 for (a, c), (b, d) in zip(got, want)), \
        (output, want)
