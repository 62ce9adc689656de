"""tpkit.trainer.SFTTrainer at tp2 (gloo processes, `from_pretrained`) against ONE process of TRL's SFTTrainer on
the same config, data and seed: TRL computes its loss, `mean_token_accuracy` and `entropy` from `lm_head.weight`
itself (on a converted model, this rank's vocabulary slice); tpkit's head computes them over the whole vocabulary.

- float64, `bf16=False`, `gradient_checkpointing=False`: loss, grad_norm, mean_token_accuracy and entropy as TRL's
  (rel 1e-6; TRL's head computes in float32), with the examples padded, with `packing=True` and with
  `padding_free=True` (one row of every example, the documents told apart by their position ids);
- TRL's defaults on this machine's CPU (bf16 autocast, gradient checkpointing), float32 weights: within bf16's
  tolerance of TRL's one process under the same defaults;
- a cp2 x tp2 model (4 processes, `tpkit.context_parallel`): the three float64 cases' figures as TRL's one process."""
from __future__ import annotations

import os

import pytest
import torch

import tpkit
from tests.trainer.common import logged, make_model, same_figures

pytestmark = pytest.mark.slow
CASES = {"padded": dict(), "packed": dict(packing=True), "padding_free": dict(padding_free=True, max_length=None),
         "defaults": dict(bf16=True, gradient_checkpointing=True)}
DTYPES = {"padded": torch.float64, "packed": torch.float64, "padding_free": torch.float64, "defaults": torch.float32}
CONTEXT = ("padded", "packed", "padding_free")  # the cases a cp2 x tp2 model runs too


def texts():
    import datasets

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(4, 14, (40,), generator=g)
    rows = [" ".join(f"w{int(i)}" for i in torch.randint(0, 90, (int(n),), generator=g)) for n in lengths]
    return datasets.Dataset.from_dict({"text": rows})


def config(out: str, **changes):
    from trl import SFTConfig

    base = dict(output_dir=out, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3, max_grad_norm=0.5,
                logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True, bf16=False,
                gradient_checkpointing=False, max_length=16, use_cpu=True, dataset_num_proc=None)
    base.update(changes)
    return SFTConfig(**base)


def _tp2(directory: str, out: str) -> dict:
    import transformers as tr

    import tpkit.trainer

    comm = tpkit.init()
    tokenizer = tr.AutoTokenizer.from_pretrained(directory)
    res = {}
    for name, changes in CASES.items():
        model = tpkit.from_pretrained(directory, comm=comm, mode="training", dtype=DTYPES[name])
        trainer = tpkit.trainer.SFTTrainer(model=model, args=config(os.path.join(out, f"tp2-{name}"), **changes),
                                           train_dataset=texts(), processing_class=tokenizer)
        trainer.train()
        res[name] = trainer.state.log_history
    return res


def _cp2_tp2(directory: str, out: str) -> dict:
    """The float64 cases on a cp2 x tp2 model (`tpkit.context_parallel` with ring attention: test_trainer.py runs the
    default, all-to-all here): each cp rank given the whole examples."""
    import transformers as tr

    import tpkit.trainer

    comm = tpkit.init()
    g = tpkit.comm.groups(comm, tp=2, cp=2)
    tokenizer = tr.AutoTokenizer.from_pretrained(directory)
    res = {}
    for name in CONTEXT:
        model = tpkit.from_pretrained(directory, comm=g.tp, mode="training", dtype=DTYPES[name])
        trainer = tpkit.trainer.SFTTrainer(model=tpkit.context_parallel(model, g.cp, method="ring"),
                                           args=config(os.path.join(out, f"cp2-tp2-{name}"), **CASES[name]),
                                           train_dataset=texts(), processing_class=tokenizer)
        trainer.train()
        res[name] = trainer.state.log_history
    return res


def _one_process(directory: str, out: str, name: str) -> list:
    import transformers as tr
    from trl import SFTTrainer

    model = tr.LlamaForCausalLM.from_pretrained(directory, dtype=DTYPES[name])
    trainer = SFTTrainer(model=model, args=config(os.path.join(out, f"ref-{name}"), **CASES[name]),
                         train_dataset=texts(), processing_class=tr.AutoTokenizer.from_pretrained(directory))
    trainer.train()
    return trainer.state.log_history


@pytest.fixture(scope="module")
def where(tmp_path_factory) -> tuple[str, str]:
    out = str(tmp_path_factory.mktemp("sft"))
    return make_model(os.path.join(out, "model")), out


@pytest.fixture(scope="module")
def runs(where):
    ours = tpkit.launch(_tp2, 2, args=where, timeout=400)[0]
    theirs = {name: _one_process(*where, name) for name in CASES}
    return ours, theirs


@pytest.fixture(scope="module")
def context(where):
    return tpkit.launch(_cp2_tp2, 4, args=where, timeout=400)[0]


@pytest.mark.parametrize("name", ["padded", "packed", "padding_free"])
def test_sft_logs_what_trl_logs_on_one_process(runs, name):
    ours, theirs = runs
    got, want = logged(ours[name]), logged(theirs[name])
    assert {k for _, k, _ in got} >= {"loss", "grad_norm", "mean_token_accuracy", "entropy"}
    assert not same_figures(got, want, 1e-6), same_figures(got, want, 1e-6)
    assert max(v for _, k, v in got if k == "grad_norm") > 0.5  # clipping was active


def test_trl_defaults_within_bf16(runs):
    ours, theirs = runs
    got, want = logged(ours["defaults"]), logged(theirs["defaults"])
    assert not same_figures(got, want, 2e-2), same_figures(got, want, 2e-2)


@pytest.mark.parametrize("name", CONTEXT)
def test_sft_on_a_context_parallel_model_logs_what_trl_logs(runs, context, name):
    """cp2 x tp2: TRL sums the head's per-token tensors, which are gathered into the whole sequences over cp (the
    padded examples, packed documents told apart by their positions, one padding-free row)."""
    got, want = logged(context[name]), logged(runs[1][name])
    assert {k for _, k, _ in got} >= {"loss", "grad_norm", "mean_token_accuracy", "entropy"}
    assert not same_figures(got, want, 1e-6), same_figures(got, want, 1e-6)
