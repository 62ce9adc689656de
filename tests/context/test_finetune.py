"""examples/finetune.py --cp on gloo processes (its `main()` under `tpkit.launch`, which sets each rank up as torchrun
does, and the cp2 x tp2 run under real torchrun), float64: the directory --consolidate writes equals
ONE process of plain transformers + torch doing the example's documented steps on the WHOLE sequences (its batch
rule, `model(input_ids=x, labels=x).loss`, backward, `clip_grad_norm_`, AdamW), and the printed loss and gradient
norm equal that process's to their 4 printed decimals: cp2 on a several-hundred-token sequence that does not divide
by 2 x cp (padded and masked), cp3 (8 query heads, 2 KV heads: they do not divide), cp2 x tp2 (one KV head per TP
rank) whose checkpoint resumes at tp2 alone, cp2 x dp2 under FSDP2, cp2 x pp2 (every micro-batch's sequence split
in each stage), and a Qwen2 with tied embeddings and q/k/v biases."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import sys

import pytest
import torch

import tpkit
from tests.torchrun import ROOT, torchrun

FINETUNE = os.path.join(ROOT, "examples", "finetune.py")
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
STEPS, LR = 3, "1e-3"


def _finetune_module():
    spec = importlib.util.spec_from_file_location("example_finetune", FINETUNE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    import transformers as tr

    root = tmp_path_factory.mktemp("cp_models")
    torch.manual_seed(0)
    tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=103, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                                       initializer_range=0.2)).save_pretrained(root / "llama")
    torch.manual_seed(1)
    tr.Qwen2ForCausalLM(tr.Qwen2Config(vocab_size=103, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                       initializer_range=0.2)).save_pretrained(root / "qwen2")
    return {"llama": str(root / "llama"), "qwen2": str(root / "qwen2")}


def _run(nproc: int, *args: str, under_torchrun: bool = False) -> str:
    """Rank 0's output of the example at `nproc` ranks: under real torchrun, or (the default, seconds faster per run
    on this box) its `main()` in `tpkit.launch`'s processes, forked from a server that imported torch and
    transformers once, each rank set up as torchrun sets its workers (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    if not under_torchrun:
        return tpkit.launch(example_main, nproc, args=(list(args),), timeout=300)[0]
    code, output, _ = torchrun(FINETUNE, *args, nproc=nproc, env=ENV, timeout=300)
    assert code == 0, output
    return output


def example_main(argv: list[str]) -> str:
    """The example's `main()` on this rank with `argv`; what it printed (a SystemExit with a message raises)."""
    module, printed = _finetune_module(), io.StringIO()
    sys.argv = [FINETUNE, *argv]
    with contextlib.redirect_stdout(printed):
        try:
            module.main()
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise RuntimeError(f"finetune.py exited: {exc.code}\n{printed.getvalue()}") from None
    return printed.getvalue()


def _printed(output: str) -> list[tuple[str, str]]:
    return re.findall(r"^step \d+: loss (\S+)\s+grad norm (\S+)", output, re.MULTILINE)


def _reference(model_dir: str, seq: int, global_batch: int, steps: int = STEPS, **load):
    """One process, no tpkit, float64: the example's batches, transformers' loss, torch's clipping and AdamW.
    `load`: more arguments of transformers' from_pretrained."""
    import transformers as tr

    finetune = _finetune_module()
    model = tr.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, **load).train()
    args = argparse.Namespace(seed=0, seq=seq, global_batch=global_batch)
    opt = torch.optim.AdamW(model.parameters(), lr=float(LR))
    printed = []
    for step in range(steps):
        ids = finetune.batch(step, None, model.config.vocab_size, args)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        printed.append((f"{loss.item():.4f}", f"{norm.item():.4f}"))
    return printed, model.state_dict()


def _equal_to_reference(output: str, out_dir: str, reference) -> None:
    from safetensors.torch import load_file

    printed, state = reference
    assert _printed(output) == printed, (output, printed)
    got = load_file(os.path.join(out_dir, "model.safetensors"))
    for key, want in state.items():
        if key not in got:  # a tied head is saved once, as transformers saves it
            continue
        err = ((got[key].double() - want).norm() / want.norm()).item()
        assert err < 1e-4, (key, err)


def _train(nproc, model_dir, tmp_path, name, seq, global_batch, *layout, steps=STEPS, resume=False, consolidate=True,
           under_torchrun=False):
    save, out = str(tmp_path / f"{name}-ckpt"), str(tmp_path / f"{name}-hf")
    args = ["--model", model_dir, *layout, "--dtype", "float64", "--seq", str(seq), "--global-batch",
            str(global_batch), "--lr", LR, "--steps", str(steps), "--save", save,
            *(["--consolidate", out] if consolidate else [])]
    return _run(nproc, *args, *(["--resume"] if resume else []), under_torchrun=under_torchrun), out


@pytest.mark.slow
def test_cp2_on_a_long_sequence_that_does_not_divide(models, tmp_path):
    output, out = _train(2, models["llama"], tmp_path, "cp2", 301, 2, "--tp", "1", "--cp", "2")
    assert "world 2 = tp1 x dp1 x cp2" in output, output
    _equal_to_reference(output, out, _reference(models["llama"], 301, 2))


@pytest.mark.slow
def test_cp3_with_heads_that_do_not_divide(models, tmp_path):
    output, out = _train(3, models["llama"], tmp_path, "cp3", 20, 2, "--tp", "1", "--cp", "3")
    _equal_to_reference(output, out, _reference(models["llama"], 20, 2))


@pytest.mark.slow
def test_cp2_x_tp2_resumes_at_tp2_alone(models, tmp_path):
    first, _ = _train(4, models["llama"], tmp_path, "cp2tp2", 24, 4, "--tp", "2", "--cp", "2", steps=2,
                      consolidate=False, under_torchrun=True)
    assert "world 4 = tp2 x dp1 x cp2" in first, first
    rest, out = _train(2, models["llama"], tmp_path, "cp2tp2", 24, 4, "--tp", "2", steps=STEPS, resume=True)
    printed, state = _reference(models["llama"], 24, 4)
    assert _printed(first) == printed[:2] and _printed(rest) == printed[2:], (first, rest, printed)
    _equal_to_reference(first + rest, out, (printed, state))


@pytest.mark.slow
def test_qwen2_tied_with_biases_at_cp2(models, tmp_path):
    output, out = _train(2, models["qwen2"], tmp_path, "qwen2", 22, 2, "--tp", "1", "--cp", "2")
    _equal_to_reference(output, out, _reference(models["qwen2"], 22, 2))


@pytest.mark.slow
@pytest.mark.parametrize("layout,seq,printed", [
    (("--tp", "1", "--cp", "2", "--dp-mode", "fsdp"), 18, "world 4 = tp1 x dp2 x cp2"),  # FSDP2 over dp x cp
    (("--pp", "2", "--cp", "2"), 14, "world 4 = pp2 x dp1 x cp2 x tp1"),  # each micro-batch split in every stage
], ids=["cp2xdp2-fsdp", "cp2xpp2"])
def test_cp2_with_data_or_pipeline_parallelism(models, tmp_path, layout, seq, printed):
    output, out = _train(4, models["llama"], tmp_path, "cp2x2", seq, 4, *layout)
    assert printed in output, output
    _equal_to_reference(output, out, _reference(models["llama"], seq, 4))
