"""The Trainer options beyond a plain run, at tp2 in gloo processes, each against ONE process of the stock library or
refused before training naming why:

- `torch_compile=True` (the bare vocabulary slice a compiled model returns gathered before `compute_metrics`);
- `push_to_hub`: the directory pushed is the collective `save_model()`'s, the one-process model (the Hub is a
  stand-in that keeps what it is sent: this machine has no network);
- `Seq2SeqTrainer` with `predict_with_generate` on a T5: the losses and the generated tokens;
- refused: `fp16`, `model_init`, a model tpkit did not convert, a pipeline stage."""
from __future__ import annotations

import os
import shutil
from unittest import mock

import numpy as np
import pytest
import torch

import tpkit
from tests.trainer.common import (arguments, eval_rows, logged, make_model, next_token_accuracy, one_process_trainer,
                                  rel, same_figures, state_of, train_rows)

pytestmark = pytest.mark.slow
COMPILED = dict(torch_compile=True, torch_compile_backend="aot_eager", max_steps=3)


class Pairs(torch.utils.data.Dataset):
    """Source and target token rows for a seq2seq model."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randint(2, 60, (n, 8), generator=g), torch.randint(2, 60, (n, 5), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def seq2seq_arguments(out: str):
    import transformers as tr

    return tr.Seq2SeqTrainingArguments(output_dir=out, max_steps=3, per_device_train_batch_size=4,
                                       per_device_eval_batch_size=3, learning_rate=1e-3, max_grad_norm=0.5,
                                       logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
                                       use_cpu=True, predict_with_generate=True, generation_max_length=6)


def make_t5(directory: str) -> str:
    import transformers as tr

    config = tr.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                         decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    tr.T5ForConditionalGeneration(config).save_pretrained(directory)
    return directory


class Hub:
    """A stand-in for huggingface_hub's API: `upload_folder` keeps a copy of what it is sent, under `root`."""

    def __init__(self, root: str):
        self.root, self.pushes = root, 0

    def create_repo(self, repo_id, **kwargs):
        return mock.Mock(repo_id=f"user/{repo_id}")

    def upload_folder(self, *, folder_path, path_in_repo=None, **kwargs):
        self.pushes += 1
        target = os.path.join(self.root, f"push-{self.pushes}")
        shutil.copytree(folder_path, target, ignore=shutil.ignore_patterns("checkpoint-*", "_*"))
        return mock.Mock()


def _tp2(directory: str, t5: str, out: str) -> dict:
    import transformers as tr

    import tpkit.trainer

    comm = tpkit.init()
    load = lambda: tpkit.from_pretrained(directory, comm=comm, mode="training", dtype=torch.float64)  # noqa: E731
    res = {}
    trainer = tpkit.trainer.Trainer(model=load(), args=arguments(os.path.join(out, "compiled"), **COMPILED),
                                    train_dataset=train_rows(), eval_dataset=eval_rows(),
                                    compute_metrics=next_token_accuracy)
    trainer.train()
    res["compiled"] = trainer.state.log_history
    hub = Hub(os.path.join(out, "hub"))
    with mock.patch("transformers.trainer.hf_api", lambda: hub):
        trainer = tpkit.trainer.Trainer(model=load(), args=arguments(os.path.join(out, "pushed"), push_to_hub=True,
                                                                     hub_strategy="end", eval_strategy="no"),
                                        train_dataset=train_rows())
        trainer.train()
        trainer.push_to_hub()
    model = tpkit.from_pretrained(t5, comm=comm, mode="training", dtype=torch.float64,
                                  model_cls=tr.T5ForConditionalGeneration)
    seq2seq = tpkit.trainer.Seq2SeqTrainer(model=model, args=seq2seq_arguments(os.path.join(out, "t5")),
                                           train_dataset=Pairs(32, 1))
    seq2seq.train()
    res["t5"] = (seq2seq.state.log_history, seq2seq.predict(Pairs(7, 2)).predictions)
    res["refused"] = _refused(load, comm, directory, out)
    return res


def _refused(load, comm, directory: str, out: str) -> dict:
    import transformers as tr

    import tpkit.trainer

    said = {}
    cases = {"fp16": lambda: tpkit.trainer.Trainer(model=load(), args=arguments(out, fp16=True)),
             "model_init": lambda: tpkit.trainer.Trainer(model_init=load, args=arguments(out)),
             "unconverted": lambda: tpkit.trainer.Trainer(model=tr.LlamaForCausalLM.from_pretrained(directory),
                                                          args=arguments(out)),
             "pipeline": lambda: tpkit.trainer.Trainer(model=tpkit.pipeline(directory, comm, pp=2).model,
                                                       args=arguments(out))}
    for name, make in cases.items():
        try:
            make()
            said[name] = "accepted"
        except Exception as exc:  # noqa: BLE001 - the message is the result
            said[name] = f"{type(exc).__name__}: {exc}"
    return said


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("options"))
    directory, t5 = make_model(os.path.join(out, "model")), make_t5(os.path.join(out, "t5-model"))
    return tpkit.launch(_tp2, 2, args=(directory, t5, out), timeout=600)[0], out


def test_torch_compile_logs_what_one_process_logs(runs):
    res, out = runs
    want = one_process_trainer(os.path.join(out, "model"), os.path.join(out, "ref-compiled"), **COMPILED)
    got, want = logged(res["compiled"]), logged(want.state.log_history)
    assert {k for _, k, _ in got} >= {"loss", "eval_loss", "eval_accuracy", "eval_perplexity"}
    assert not same_figures(got, want, 1e-6), same_figures(got, want, 1e-6)


def test_push_to_hub_pushes_the_one_process_model(runs):
    res, out = runs
    pushed = sorted(d for d in os.listdir(os.path.join(out, "hub")))
    final = os.path.join(out, "hub", pushed[-1])
    reference = one_process_trainer(os.path.join(out, "model"), os.path.join(out, "ref-pushed"), eval_strategy="no")
    ours, theirs = state_of(final), state_of(os.path.join(out, "ref-pushed", "final"))
    assert ours.keys() == theirs.keys() and max(rel(ours[k], theirs[k]) for k in ours) < 1e-4
    assert reference.state.global_step == 6


def test_seq2seq_trainer_predicts_with_generate_as_one_process(runs):
    import transformers as tr

    res, out = runs
    history, predictions = res["t5"]
    model = tr.T5ForConditionalGeneration.from_pretrained(os.path.join(out, "t5-model"), dtype=torch.float64)
    one = tr.Seq2SeqTrainer(model=model, args=seq2seq_arguments(os.path.join(out, "ref-t5")),
                            train_dataset=Pairs(32, 1))
    one.train()
    assert not same_figures(logged(history), logged(one.state.log_history), 1e-6)
    assert [h["total_flos"] for h in history if "total_flos" in h] == \
        [h["total_flos"] for h in one.state.log_history if "total_flos" in h]  # counted once, not once per rank
    want = one.predict(Pairs(7, 2)).predictions
    assert predictions.shape == want.shape and np.array_equal(predictions, want)


def test_what_cannot_be_exact_is_refused_naming_why(runs):
    said = runs[0]["refused"]
    assert said["fp16"].startswith("TrainerSetupError") and "bf16" in said["fp16"], said
    assert said["model_init"].startswith("TrainerSetupError") and "model_init" in said["model_init"], said
    assert said["unconverted"].startswith("TrainerSetupError") and "transformers.Trainer" in said["unconverted"], said
    assert said["pipeline"].startswith("TrainerSetupError") and "pipeline" in said["pipeline"], said
