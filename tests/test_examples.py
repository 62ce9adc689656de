"""The newcomer's examples under real torchrun (2 gloo processes) on a tiny Llama saved with a word-level tokenizer:
examples/finetune.py at tp2 trains as one process would (losses and weights against plain transformers + AdamW),
resumes to the end of an uninterrupted run bit for bit, and its --consolidate directory loads in transformers; a
bf16 checkpoint trains in the --dtype asked for;
at tp1 x dp2 under FSDP2 it trains the same; examples/generate.py at tp2 gives transformers' own greedy tokens;
examples/lora.py at tp2 trains a LoRA adapter as one PEFT process does and saves the stock adapter files."""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re

import pytest
import torch

from tests.torchrun import ROOT, torchrun

EXAMPLES = os.path.join(ROOT, "examples")
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
TRAIN = ("--seq", "16", "--global-batch", "4", "--lr", "1e-3", "--max-norm", "1.0")


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """A tiny Llama (random weights, initialised wide enough that greedy decoding does not repeat one token) with a
    word-level tokenizer "w0" .. "w99", and some text of those words in train.txt beside it."""
    import transformers as tr
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("examples")
    directory = str(root / "llama")
    config = tr.LlamaConfig(vocab_size=103, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                            initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    tr.LlamaForCausalLM(config).save_pretrained(directory)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(100)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tr.PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<s>", eos_token="</s>",
                               pad_token="<pad>").save_pretrained(directory)
    g = torch.Generator().manual_seed(1)
    text = [" ".join(f"w{int(i)}" for i in torch.randint(0, 20, (24,), generator=g)) for _ in range(20)]
    (root / "train.txt").write_text("\n".join(text) + "\n")
    return directory


def _run(script: str, *args: str, env: dict | None = None) -> str:
    code, output, _ = torchrun(os.path.join(EXAMPLES, script), *args, nproc=2, env={**ENV, **(env or {})})
    assert code == 0, output
    return output


def _losses(output: str) -> dict[int, str]:
    """Step -> the loss rank 0 printed."""
    return {int(s): loss for s, loss in re.findall(r"^step (\d+): loss (\S+)", output, re.MULTILINE)}


def _reference(llama: str, data: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, no tpkit: transformers' model, torch's AdamW and clipping, the example's batches."""
    import transformers as tr

    finetune = _example("finetune")
    model = tr.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).train()
    tokens = finetune.load_tokens(data, finetune.tokenizer_in(llama), model.config.vocab_size)
    args = argparse.Namespace(seed=0, seq=16, global_batch=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        ids = finetune.batch(step, tokens, model.config.vocab_size, args)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _weights(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def _close_to_reference(output: str, out_dir: str, reference) -> None:
    losses, state = reference
    printed = _losses(output)
    assert sorted(printed) == list(range(1, len(losses) + 1)), output
    assert all(math.isfinite(float(v)) for v in printed.values()), output
    assert all(abs(float(printed[s + 1]) - want) < 2e-4 for s, want in enumerate(losses)), (printed, losses)
    got = _weights(out_dir)
    assert got.keys() == state.keys()
    for k, want in state.items():  # AdamW's first steps move each weight by about lr: rounding stays far below
        assert torch.allclose(got[k], want, rtol=0, atol=1e-4), (k, (got[k] - want).abs().max())


@pytest.mark.slow
def test_finetune_at_tp2_resumes_as_an_uninterrupted_run_and_consolidates_for_transformers(llama, tmp_path):
    import transformers as tr

    data = os.path.join(os.path.dirname(llama), "train.txt")
    common = ("--model", llama, "--tp", "2", "--data", data, *TRAIN)
    clean = _run("finetune.py", *common, "--steps", "4", "--every", "2", "--save", str(tmp_path / "clean"),
                 "--consolidate", str(tmp_path / "hf-clean"))
    first = _run("finetune.py", *common, "--steps", "2", "--save", str(tmp_path / "ckpt"))
    rest = _run("finetune.py", *common, "--steps", "4", "--every", "2", "--save", str(tmp_path / "ckpt"), "--resume",
                "--consolidate", str(tmp_path / "hf"))
    assert "world 2 = tp2 x dp1" in clean and "starting at step 2" in rest, rest
    assert {**_losses(first), **_losses(rest)} == _losses(clean)
    resumed, uninterrupted = _weights(str(tmp_path / "hf")), _weights(str(tmp_path / "hf-clean"))
    assert resumed.keys() == uninterrupted.keys() and all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    _close_to_reference(clean, str(tmp_path / "hf-clean"), _reference(llama, data, 4))

    tuned = tr.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))  # an ordinary HF directory, tokenizer too
    original = tr.AutoModelForCausalLM.from_pretrained(llama)
    assert {k: v.shape for k, v in tuned.state_dict().items()} == {k: v.shape for k, v in original.state_dict().items()}
    assert tr.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))("w1 w2").input_ids == [4, 5]


@pytest.mark.slow
def test_finetune_trains_a_bf16_checkpoint_in_the_dtype_asked_for(llama, tmp_path):
    """A bf16 checkpoint with `--dtype float32` (the default) trains in float32: the losses and weights of one
    float32 process of transformers (its float32 load of the same bf16 directory), and the consolidated directory
    is float32, config.json included. It used to train in bf16, silently (losses 1e-2 off)."""
    import json

    import transformers as tr
    from safetensors import safe_open

    half = os.path.join(os.path.dirname(llama), "llama-bf16")
    if not os.path.isdir(half):
        tr.AutoModelForCausalLM.from_pretrained(llama).to(torch.bfloat16).save_pretrained(half)
        tr.AutoTokenizer.from_pretrained(llama).save_pretrained(half)
    data, out = os.path.join(os.path.dirname(llama), "train.txt"), str(tmp_path / "hf")
    output = _run("finetune.py", "--model", half, "--tp", "2", "--data", data, *TRAIN, "--steps", "2",
                  "--save", str(tmp_path / "ckpt"), "--consolidate", out)
    losses, state = _reference(half, data, 2)
    printed = _losses(output)
    assert all(abs(float(printed[s + 1]) - want) < 2e-4 for s, want in enumerate(losses)), (printed, losses)
    got = _weights(out)
    for k, want in state.items():  # AdamW moves a weight whose gradient is within rounding of 0 by up to lr
        assert got[k].dtype == torch.float32 and torch.allclose(got[k], want, rtol=0, atol=1e-3), k
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"


@pytest.mark.slow
def test_finetune_at_tp1_dp2_under_fsdp_trains_as_one_process(llama, tmp_path):
    data = os.path.join(os.path.dirname(llama), "train.txt")
    output = _run("finetune.py", "--model", llama, "--tp", "1", "--dp-mode", "fsdp", "--data", data, *TRAIN,
                  "--steps", "3", "--save", str(tmp_path / "ckpt"), "--consolidate", str(tmp_path / "hf"))
    assert "world 2 = tp1 x dp2" in output, output
    _close_to_reference(output, str(tmp_path / "hf"), _reference(llama, data, 3))


@pytest.mark.slow
def test_generate_at_tp2_gives_transformers_greedy_tokens(llama):
    """float32: token for token; TPKIT_THREADS sizes each rank's threads (torchrun alone would give 1)."""
    import transformers as tr

    output = _run("generate.py", "--model", llama, "--prompt", "w1 w7 w3", "--max-new-tokens", "12",
                  env={"TPKIT_THREADS": "2"})
    model, tokenizer = tr.AutoModelForCausalLM.from_pretrained(llama), tr.AutoTokenizer.from_pretrained(llama)
    ids = tokenizer("w1 w7 w3", return_tensors="pt").input_ids
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert len(set(want)) > 3  # the tokens say something: greedy decoding has not settled on one token
    assert "world 2, tp2, 2 thread(s) per rank" in output, output
    assert re.search(r"^new ids: (.*)$", output, re.MULTILINE).group(1) == " ".join(map(str, want)), (output, want)
    assert f"text: {tokenizer.decode(ids[0].tolist() + want, skip_special_tokens=True)}" in output


def test_finetune_data_is_text_through_the_tokenizer_or_integer_ids(llama, tmp_path):
    finetune = _example("finetune")
    text, ids = tmp_path / "a.txt", tmp_path / "ids.txt"
    text.write_text("w0 w1\nw2  w99\n")
    ids.write_text("3 4\n5 102\n")
    tokenizer = finetune.tokenizer_in(llama)
    assert finetune.load_tokens(str(text), tokenizer, 103).tolist() == [3, 4, 5, 102]
    assert finetune.tokenizer_in(str(tmp_path)) is None  # no tokenizer files: the data are ids
    assert finetune.load_tokens(str(ids), None, 103).tolist() == [3, 4, 5, 102]
    with pytest.raises(SystemExit, match="integer token ids"):
        finetune.load_tokens(str(text), None, 103)
    with pytest.raises(SystemExit, match=r"token ids must be in 0\.\.99"):
        finetune.load_tokens(str(ids), None, 100)
    args = argparse.Namespace(seed=0, seq=3, global_batch=2)
    stream = torch.arange(10)
    b = finetune.batch(5, stream, 103, args)
    assert torch.equal(b, finetune.batch(5, stream, 103, args))  # a function of the step alone
    assert all(torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 3)) for row in b)  # windows of the stream
    assert finetune.batch(5, None, 103, args).shape == (2, 3)


@pytest.mark.slow
def test_lora_at_tp2_trains_as_one_peft_process_and_saves_a_stock_adapter(llama, tmp_path):
    """examples/lora.py at tp2: the losses of one process of transformers + PEFT + AdamW on the same batches, and
    an adapter directory PEFT loads on one process holding that process's trained adapter."""
    import peft
    import transformers as tr
    from safetensors.torch import load_file

    data = os.path.join(os.path.dirname(llama), "train.txt")
    out = str(tmp_path / "adapter")
    output = _run("lora.py", "--model", llama, "--data", data, "--seq", "16", "--global-batch", "4", "--lr", "1e-3",
                  "--steps", "3", "--out", out)
    finetune = _example("finetune")
    model = tr.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).train()
    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                       target_modules=_example("lora").TARGETS.split(",")))
    tokens = finetune.load_tokens(data, finetune.tokenizer_in(llama), model.config.vocab_size)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for step in range(3):
        ids = finetune.batch(step, tokens, model.config.vocab_size, argparse.Namespace(seed=0, seq=16, global_batch=4))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    printed = _losses(output)
    assert sorted(printed) == [1, 2, 3], output
    assert all(abs(float(printed[s + 1]) - want) < 2e-4 for s, want in enumerate(losses)), (printed, losses)
    saved = load_file(os.path.join(out, "adapter_model.safetensors"))
    want = {k: v for k, v in peft.get_peft_model_state_dict(model).items()}
    assert saved.keys() == want.keys()
    for k, v in want.items():
        assert torch.allclose(saved[k], v, rtol=0, atol=1e-4), (k, (saved[k] - v).abs().max())
    loaded = peft.PeftModel.from_pretrained(tr.AutoModelForCausalLM.from_pretrained(llama), out)
    assert set(loaded.peft_config["default"].target_modules) == set(_example("lora").TARGETS.split(","))


@pytest.mark.slow
def test_trainer_example_at_tp2_equals_one_process_of_plain_trainer_and_resumes(llama, tmp_path):
    """examples/trainer.py under torchrun at tp2 (tpkit.trainer.Trainer) against the same arguments and windows in
    ONE process of plain transformers.Trainer: the logged losses, gradient norms and eval losses, and the directory
    it writes. (Resuming, `--resume`, is Trainer's own `resume_from_checkpoint=True`: tests/trainer resumes bit for
    bit.)"""
    import transformers as tr

    trainer = _example("trainer")
    data = os.path.join(os.path.dirname(llama), "train.txt")
    common = ("--model", llama, "--tp", "2", "--data", data, "--seq", "16", "--batch", "2", "--lr", "1e-3",
              "--max-norm", "0.5", "--eval", "2", "--save-steps", "2")
    _run("trainer.py", *common, "--steps", "4", "--out", str(tmp_path / "run"))

    args = trainer.parser().parse_args([*common, "--steps", "4", "--out", str(tmp_path / "reference")])
    model = tr.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    train, evaluation = trainer.datasets(args, model.config.vocab_size)
    one = tr.Trainer(model=model, args=trainer.training_arguments(args), train_dataset=train,
                     eval_dataset=evaluation)
    one.train()
    one.save_model()

    def figures(directory: str) -> list[tuple]:
        import json

        with open(os.path.join(directory, "checkpoint-4", "trainer_state.json")) as f:
            history = json.load(f)["log_history"]
        return [(h["step"], k, h[k]) for h in history for k in ("loss", "grad_norm", "eval_loss") if k in h]

    want, got = figures(str(tmp_path / "reference")), figures(str(tmp_path / "run"))
    assert [x[:2] for x in got] == [x[:2] for x in want] and all(
        abs(a[2] - b[2]) <= 1e-5 * abs(b[2]) for a, b in zip(got, want)), (got, want)
    ours, theirs = _weights(str(tmp_path / "run")), _weights(str(tmp_path / "reference"))
    assert ours.keys() == theirs.keys()
    assert all(torch.allclose(ours[k], theirs[k], rtol=0, atol=1e-4) for k in ours)  # float32 AdamW, as above


@pytest.mark.slow
def test_sft_example_at_tp2_logs_what_trl_logs_on_one_process(llama, tmp_path):
    """examples/sft.py under torchrun at tp2 (tpkit.trainer.SFTTrainer) against TRL's SFTTrainer in one process, the
    example's own config and data, without bf16 and checkpointing (a CPU float32 run): loss, mean_token_accuracy and
    entropy as TRL logs them."""
    import json

    import transformers as tr
    from trl import SFTTrainer

    sft = _example("sft")
    data = os.path.join(os.path.dirname(llama), "train.txt")
    flags = ("--model", llama, "--data", data, "--steps", "3", "--batch", "2", "--seq", "16", "--lr", "1e-3",
             "--no-gradient-checkpointing")
    output = _run("sft.py", *flags, "--out", str(tmp_path / "tp2"))
    assert "wrote" in output, output
    args = sft.parser().parse_args([*flags, "--out", str(tmp_path / "one")])
    one = SFTTrainer(model=tr.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32),
                     args=sft.config(args), train_dataset=sft.dataset(data),
                     processing_class=tr.AutoTokenizer.from_pretrained(llama))
    one.train()
    logged = re.findall(r"^\{'loss': .*$", output, re.MULTILINE)
    want = [h for h in one.state.log_history if "loss" in h]
    assert len(logged) == len(want) == 3, output
    for line, h in zip(logged, want):
        got = json.loads(line.replace("'", '"'))
        for key in ("loss", "mean_token_accuracy", "entropy"):
            assert abs(float(got[key]) - h[key]) <= 1e-3 * max(abs(h[key]), 1e-3), (key, got, h)
