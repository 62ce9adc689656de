"""tpkit.trainer on an expert-parallel Qwen3-MoE (`tpkit.expert_parallel`; 6 fused experts, top-2) against ONE process
of plain transformers.Trainer on the whole global batch (transformers' eager experts: its fused kernel has no
float64), in real gloo processes, float64, clipping active:

- 4 ranks: tp2 x dp2 with ep4 (DDP), dp4 with ep4 (FSDP2; 6 experts over 4 ranks hold 2, 2, 1, 1) and cp2 x dp2 with
  ep4 (`tpkit.context_parallel` then `expert_parallel`; DDP) log the reference's loss, grad_norm, eval_loss and
  full-logits metrics, count its tokens and flops, and `save_model()` writes its directory (each expert gathered from
  the rank holding it); the tp2 x dp2 run's checkpoint-3 resumed at dp4 with ep2 ends where the reference does;
  experts sharing rows over another tp group than the model's, a load-balancing loss over each replica's tokens,
  even_batches=False and a LoRA adapter on the experts' weights are refused, naming tpkit's way;
- 2 ranks: ep2 over dp2 (DDP) and ep2 = tp2 the same; on ep2 over dp2, a PEFT LoRA model (attention adapters, under
  DDP below PEFT's wrapper) trains and saves the adapter stock PEFT + Trainer does, and TRL's SFTTrainer logs TRL's one
  process's loss, grad_norm, mean_token_accuracy and entropy.

The eval set is 12 rows in batches of 3: whole batches on every replica (a short last batch, padded by accelerate to
fill the replicas, changes the eval_loss of any data-parallel run, tpkit's or plain Trainer's). With tp2 the figures
agree to 1e-5 (a tp2 conversion of this model without expert parallelism moves them as much: one grad_norm by 1.1e-6),
at tp1 to 1e-6, the weights there to 1e-10."""
from __future__ import annotations

import os

import pytest
import torch

import tpkit
from tests.trainer.common import (STEPS, Rows, arguments, logged, next_token_accuracy, rel, same_figures,
                                  save_tokenizer, train_rows)

pytestmark = pytest.mark.slow
TIGHT, TP = 1e-6, 1e-5  # logged figures at tp1 / with tp2
FOUR = {"tp2-dp2-ep4": (2, 4, dict(per_device_train_batch_size=2, save_strategy="steps", save_steps=3)),
        "dp4-ep4-fsdp": (1, 4, dict(per_device_train_batch_size=1, fsdp="full_shard")),
        "cp2-dp2-ep4": (1, 4, dict(per_device_train_batch_size=2), 2)}  # (tp, ep, arguments[, cp])
TWO = {"ep2-over-dp2": (1, 2, dict(per_device_train_batch_size=2)), "ep2-is-tp2": (2, 2, {})}
SFT = dict(router_aux_loss_coef=0.0)  # TRL's default coefficient turns the router's load-balancing loss on


def eval_rows() -> Rows:
    return Rows(12, 2)


def make_moe(directory: str) -> str:
    import transformers as tr

    config = tr.Qwen3MoeConfig(vocab_size=103, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               num_experts=6, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                               max_position_embeddings=64, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                               pad_token_id=0)
    torch.manual_seed(0)
    tr.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return save_tokenizer(directory)


def state_of(directory: str) -> dict[str, torch.Tensor]:
    import transformers as tr

    return tr.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64).state_dict()


# ----------------------------------------------------------------------------------------------- rank bodies

def _expert_parallel(directory: str, comm, tp: int, ep: int, model_groups=None, cp: int = 1):
    """The MoE converted on `tpkit.comm.groups(comm, tp, cp, ep=ep)`'s tp group with its experts whole (made
    context-parallel over its cp group when cp > 1), then spread over its expert group (or `model_groups`')."""
    g = tpkit.comm.groups(comm, tp=tp, cp=cp, ep=ep)
    model = tpkit.from_pretrained(directory, comm=g.tp, mode="training", dtype=torch.float64,
                                  plan=tpkit.KEEP_EXPERTS_WHOLE)
    if cp > 1:  # whole rows on every cp rank, each keeping its share of the tokens
        tpkit.context_parallel(model, g.cp)
    return tpkit.expert_parallel(model, model_groups or g)


def _lora(model, **changes):
    import peft

    torch.manual_seed(0)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0, init_lora_weights=False, **changes))


def _trainer(model, out: str, **changes):
    import tpkit.trainer

    return tpkit.trainer.Trainer(model=model, args=arguments(out, **changes), train_dataset=train_rows(),
                                 eval_dataset=eval_rows(), compute_metrics=next_token_accuracy)


def _train(directory: str, out: str, comm, runs: dict) -> dict:
    res = {}
    for name, (tp, ep, changes, *cp) in runs.items():
        trainer = _trainer(_expert_parallel(directory, comm, tp, ep, cp=cp[0] if cp else 1), os.path.join(out, name),
                           **changes)
        trainer.train()
        trainer.save_model()
        res[name] = {"history": trainer.state.log_history, "tokens": trainer.state.num_input_tokens_seen}
    return res


def _four(directory: str, out: str) -> dict:
    """4 ranks: the `FOUR` runs, checkpoint-3 resumed at dp4 with ep2, and the refusals."""
    comm = tpkit.init()
    res = _train(directory, out, comm, FOUR)
    resumed = _trainer(_expert_parallel(directory, comm, 1, 2), os.path.join(out, "resumed"),
                       per_device_train_batch_size=1)
    resumed.train(resume_from_checkpoint=os.path.join(out, "tp2-dp2-ep4", "checkpoint-3"))
    resumed.save_model()
    res["resumed"] = resumed.state.log_history

    def router_loss():
        model = _expert_parallel(directory, comm, 1, 4)
        model.config.output_router_logits = True
        return _trainer(model, os.path.join(out, "refused"))

    said = {}
    for name, make in (("groups", lambda: _trainer(_expert_parallel(directory, comm, 1, 2, tpkit.comm.groups(
                           comm, tp=2, ep=2)), os.path.join(out, "refused"))),
                       ("router", router_loss),
                       ("even", lambda: _trainer(_expert_parallel(directory, comm, 1, 4), os.path.join(out, "refused"),
                                                 accelerator_config={"even_batches": False})),
                       ("adapter", lambda: _trainer(_lora(_expert_parallel(directory, comm, 1, 4), target_parameters=[
                           "mlp.experts.gate_up_proj"]), os.path.join(out, "refused")))):
        try:
            make()
            said[name] = "accepted"
        except Exception as exc:  # noqa: BLE001 - the message is the result
            said[name] = f"{type(exc).__name__}: {exc}"
    res["refused"] = said
    return res


def _two(directory: str, out: str) -> dict:
    """2 ranks: the `TWO` runs, then a LoRA model and TRL's SFTTrainer on ep2 over dp2."""
    import transformers as tr

    import tpkit.trainer
    from tests.trainer.test_sft import config, texts

    comm = tpkit.init()
    res = _train(directory, out, comm, TWO)
    lora = _trainer(_lora(_expert_parallel(directory, comm, 1, 2)), os.path.join(out, "lora"),
                    per_device_train_batch_size=2)
    lora.train()
    lora.save_model()
    res["lora"] = lora.state.log_history
    sft = tpkit.trainer.SFTTrainer(model=_expert_parallel(directory, comm, 1, 2),
                                   args=config(os.path.join(out, "sft"), per_device_train_batch_size=2, **SFT),
                                   train_dataset=texts(), processing_class=tr.AutoTokenizer.from_pretrained(directory))
    sft.train()
    res["sft"] = sft.state.log_history
    return res


# ----------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def out(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("trainer_experts")
    make_moe(str(root / "moe"))
    return str(root)


@pytest.fixture(scope="module")
def four(out):
    return tpkit.launch(_four, 4, args=(os.path.join(out, "moe"), out), timeout=400)[0]


@pytest.fixture(scope="module")
def two(out):
    return tpkit.launch(_two, 2, args=(os.path.join(out, "moe"), out), timeout=400)[0]


def _one_process(out: str, name: str, wrap=lambda model: model) -> list[dict]:
    """ONE process of plain transformers.Trainer on the unconverted model (`wrap`: stock PEFT around it), 4 rows a
    step; its log history."""
    import transformers as tr

    model = tr.AutoModelForCausalLM.from_pretrained(os.path.join(out, "moe"), dtype=torch.float64,
                                                    experts_implementation="eager")
    trainer = tr.Trainer(model=wrap(model), args=arguments(os.path.join(out, name)), train_dataset=train_rows(),
                         eval_dataset=eval_rows(), compute_metrics=next_token_accuracy)
    trainer.train()
    trainer.save_model()
    return trainer.state.log_history


@pytest.fixture(scope="module")
def reference(out):
    return _one_process(out, "ref")


@pytest.fixture(scope="module")
def lora_reference(out):
    return _one_process(out, "ref-lora", _lora)


@pytest.fixture(scope="module")
def sft_reference(out):
    """ONE process of TRL's SFTTrainer on the unconverted model, 4 examples a step."""
    import transformers as tr
    from trl import SFTTrainer

    from tests.trainer.test_sft import config, texts

    directory = os.path.join(out, "moe")
    model = tr.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, experts_implementation="eager")
    trainer = SFTTrainer(model=model, args=config(os.path.join(out, "ref-sft"), **SFT), train_dataset=texts(),
                         processing_class=tr.AutoTokenizer.from_pretrained(directory))
    trainer.train()
    return trainer.state.log_history


# ----------------------------------------------------------------------------------------------- tests

def _same_run(res: dict, reference: list, out: str, name: str, tolerance: float, weights: float) -> None:
    got, want = logged(res["history"]), logged(reference)
    assert not same_figures(got, want, tolerance), (name, same_figures(got, want, tolerance))
    assert {k for _, k, _ in got} >= {"loss", "grad_norm", "eval_loss", "eval_accuracy", "eval_perplexity"}
    assert max(v for _, k, v in got if k == "grad_norm") > 0.5  # clipping was active
    flops = lambda history: [h["total_flos"] for h in history if "total_flos" in h]  # noqa: E731
    assert flops(res["history"]) == flops(reference)  # every expert counted once, each replica's tokens once
    assert res["tokens"] == STEPS * 4 * 12
    ours, theirs = state_of(os.path.join(out, name)), state_of(os.path.join(out, "ref"))
    assert ours.keys() == theirs.keys() and max(rel(ours[k], theirs[k]) for k in ours) < weights, name


@pytest.mark.parametrize("name", list(FOUR))
def test_four_ranks_train_and_save_what_one_process_does(four, reference, out, name):
    tp = FOUR[name][0]
    _same_run(four[name], reference, out, name, TP if tp > 1 else TIGHT, 1e-4 if tp > 1 else 1e-10)


@pytest.mark.parametrize("name", list(TWO))
def test_two_ranks_train_and_save_what_one_process_does(two, reference, out, name):
    tp = TWO[name][0]
    _same_run(two[name], reference, out, name, TP if tp > 1 else TIGHT, 1e-4 if tp > 1 else 1e-10)


def test_an_expert_parallel_checkpoint_resumes_at_another_layout(four, reference, out):
    """tp2 x dp2 with ep4's checkpoint-3, resumed at dp4 with ep2: the reference's steps 4 to 6 and weights."""
    got = [x for x in logged(four["resumed"]) if x[0] > 3]
    want = [x for x in logged(reference) if x[0] > 3]
    assert got and not same_figures(got, want, TP), same_figures(got, want, TP)
    ours, theirs = state_of(os.path.join(out, "resumed")), state_of(os.path.join(out, "ref"))
    assert max(rel(ours[k], theirs[k]) for k in ours) < 1e-4


def test_lora_on_an_expert_parallel_model_trains_and_saves_as_stock_peft(two, lora_reference, out):
    from safetensors.torch import load_file

    assert not same_figures(logged(two["lora"]), logged(lora_reference), TIGHT), \
        same_figures(logged(two["lora"]), logged(lora_reference), TIGHT)
    ours = load_file(os.path.join(out, "lora", "adapter_model.safetensors"))
    theirs = load_file(os.path.join(out, "ref-lora", "adapter_model.safetensors"))
    assert ours.keys() == theirs.keys() and max(rel(ours[k], theirs[k]) for k in ours) < 1e-10


def test_sft_on_an_expert_parallel_model_logs_what_trl_logs(two, sft_reference):
    got, want = logged(two["sft"]), logged(sft_reference)
    assert {k for _, k, _ in got} >= {"loss", "grad_norm", "mean_token_accuracy", "entropy"}
    assert not same_figures(got, want, TIGHT), same_figures(got, want, TIGHT)


def test_what_an_expert_parallel_model_cannot_train_exactly_is_refused(four):
    said = four["refused"]
    assert said["groups"].startswith("TrainerSetupError") and "tpkit.comm.groups(world, tp=1, ep=2)" in \
        said["groups"] and "tpkit.expert_parallel(model, g)" in said["groups"], said
    assert said["router"].startswith("TrainerSetupError") and "output_router_logits=False" in said["router"], said
    assert said["even"].startswith("TrainerSetupError") and "even_batches" in said["even"], said
    assert said["adapter"].startswith("TrainerSetupError") and "mlp.experts" in said["adapter"] and \
        "target_modules" in said["adapter"], said
