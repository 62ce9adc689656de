"""tpkit.trainer.Trainer against ONE process of plain transformers.Trainer on the same arguments, data and seed, in
real gloo processes (`tpkit.launch`, torchrun's environment), float64, clipping active:

- tp2 (`from_pretrained`): the per-step loss and grad_norm, eval_loss and a compute_metrics that reads the full
  logits (argmax accuracy, perplexity) equal the reference's; `save_model()` writes a directory plain transformers
  loads equal to the reference's weights, beside the checkpoint-N folders it leaves alone; `checkpoint-3` resumed to
  step 6 ends where the uninterrupted run does; the stock Trainer, a hand-made DDP and a hand-made fully_shard on a
  converted model stop before anything trains, naming tpkit's way;
- tp3 (`parallelize`, 8 heads / 4 KV heads): the same figures, with save_total_limit and load_best_model_at_end as
  the reference keeps them; a PEFT LoRA model trains and saves the adapter stock PEFT + Trainer saves;
- tp2 x dp2 on 4 ranks (2 rows per dp replica), under DDP and FSDP2, equals plain Trainer's own data parallelism at
  dp2 (2 processes); tp2's checkpoint-3 resumed at tp3 and at tp2 x dp2 ends near the uninterrupted tp2 run;
- context parallelism on 4 ranks (`tpkit.context_parallel`, method "auto"; each cp rank given the whole rows): cp2 x
  tp2 and cp4 alone (12 tokens padded to 16) log what one process logs, eval metrics on the whole sequences'
  logits, and save its weights; cp2 x dp2 under DDP and FSDP2 equals plain Trainer's dp2; tp2's checkpoint-3 resumes
  at cp2 x tp2; with average_tokens_across_devices=False the loss is still one process's; tp / cp groups other than
  `tpkit.comm.groups`' and a loss from the logits are refused."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import tpkit
from tests.trainer.common import (STEPS, arguments, eval_rows, logged, make_model, next_token_accuracy,
                                  one_process_trainer, rel, same_figures, state_of, train_rows)

pytestmark = pytest.mark.slow
TIGHT = 1e-6  # logged figures (float32 running loss of float64 models)


# ----------------------------------------------------------------------------------------------- rank bodies

def _trainer(model, out: str, **changes):
    import tpkit.trainer

    return tpkit.trainer.Trainer(model=model, args=arguments(out, **changes), train_dataset=train_rows(),
                                 eval_dataset=eval_rows(), compute_metrics=next_token_accuracy)


def _tp2(directory: str, out: str) -> dict:
    """tp2 from_pretrained: a run with checkpoints, its resume, then the stock tools that must refuse."""
    import transformers as tr

    comm = tpkit.init()
    res = {}
    load = lambda: tpkit.from_pretrained(directory, comm=comm, mode="training", dtype=torch.float64)  # noqa: E731
    run = os.path.join(out, "tp2")
    trainer = _trainer(load(), run, save_strategy="steps", save_steps=3)
    trainer.train()
    trainer.save_model(run)  # one HF directory, beside checkpoint-3 and checkpoint-6
    res.update(history=trainer.state.log_history, tokens=trainer.state.num_input_tokens_seen,
               listing=sorted(os.listdir(run)), checkpoint=sorted(os.listdir(os.path.join(run, "checkpoint-3"))))
    again = os.path.join(out, "tp2-resumed")  # the run stopped at step 3: its output_dir holds checkpoint-3
    if comm.rank == 0:
        shutil.copytree(os.path.join(run, "checkpoint-3"), os.path.join(again, "checkpoint-3"))
    comm.barrier()
    resumed = _trainer(load(), again)
    resumed.train(resume_from_checkpoint=True)  # the newest checkpoint-N in output_dir
    resumed.save_model()
    res["resumed"] = resumed.state.log_history
    res["refusals"] = _refusals(load(), comm, out, tr)
    return res


def _even(comm, tr):
    """A converted model whose every split is even (vocabulary 96): FSDP2 can all-gather its slices as if they were
    one tensor's (uneven slices make its first all-gather fail on its own, gloo naming the size mismatch)."""
    config = tr.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                            num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    return tpkit.parallelize(tr.LlamaForCausalLM(config), comm=comm, mode="training")


def _refusals(model, comm, out: str, tr) -> dict:
    """What the stock tools do with a converted model: each error's message, or what happened instead."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    said = {}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for name, run in (("trainer", lambda: tr.Trainer(model=model, args=arguments(os.path.join(out, "stock"),
                                                                                      eval_strategy="no"),
                                                     train_dataset=train_rows()).train()),
                      ("ddp", lambda: DistributedDataParallel(model)),
                      ("fully_shard", lambda: fully_shard(_even(comm, tr))(
                          input_ids=train_rows()[0]["input_ids"][None]))):
        try:
            run()
            said[name] = "ran"
        except Exception as exc:  # noqa: BLE001 - the message is the result
            said[name] = f"{type(exc).__name__}: {exc}"
        if name == "ddp":
            said["unchanged"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return said


def _tp3(directory: str, out: str) -> dict:
    """tp3 through parallelize: rotation and the best model at the end; then a PEFT LoRA model."""
    import peft
    import transformers as tr

    comm = tpkit.init()
    base = tr.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float64)
    model = tpkit.parallelize(base, comm=comm, mode="training")
    run = os.path.join(out, "tp3")
    trainer = _trainer(model, run, **_BEST)
    trainer.train()
    trainer.save_model(os.path.join(run, "final"))
    res = {"history": trainer.state.log_history, "listing": sorted(os.listdir(run))}
    torch.manual_seed(0)
    lora = peft.get_peft_model(tpkit.parallelize(tr.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float64),
                                                 comm=comm, mode="training"), _lora_config())
    adapter = _trainer(lora, os.path.join(out, "tp3-lora"))
    adapter.train()
    adapter.save_model()
    res["lora"] = adapter.state.log_history
    model = tpkit.from_pretrained(directory, comm=comm, mode="training", dtype=torch.float64)
    resumed = _trainer(model, os.path.join(out, "tp3-resumed"))  # tp2's checkpoint at another tensor-parallel size
    resumed.train(resume_from_checkpoint=os.path.join(out, "tp2", "checkpoint-3"))
    resumed.save_model()
    res["resumed"] = resumed.state.log_history
    return res


_BEST = dict(save_strategy="steps", save_steps=3, save_total_limit=1, load_best_model_at_end=True,
             metric_for_best_model="eval_loss")


def _lora_config():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                           init_lora_weights=False)


def _dp(directory: str, out: str) -> dict:
    """tp2 x dp2: DDP, FSDP2, and tp2's checkpoint-3 resumed at this layout."""
    comm = tpkit.init()
    tp, _ = tpkit.comm.split(comm, 2)
    res = {}
    for name, changes in (("ddp", {}), ("fsdp", {"fsdp": "full_shard"})):
        model = tpkit.from_pretrained(directory, comm=tp, mode="training", dtype=torch.float64)
        trainer = _trainer(model, os.path.join(out, f"dp-{name}"), per_device_train_batch_size=2, **changes)
        trainer.train()
        trainer.save_model()
        res[name] = trainer.state.log_history
    model = tpkit.from_pretrained(directory, comm=tp, mode="training", dtype=torch.float64)
    resumed = _trainer(model, os.path.join(out, "dp-resumed"), per_device_train_batch_size=2)
    resumed.train(resume_from_checkpoint=os.path.join(out, "tp2", "checkpoint-3"))
    resumed.save_model()
    res["resumed"] = resumed.state.log_history
    return res


# The method the context-parallel runs use: tpkit's default, which picks all-to-all for every layer here (the local
# K/V heads divide by cp); test_sft.py runs the ring.
CP_METHOD = "auto"


def _context_parallel(directory: str, comm, tp: int, cp: int):
    """The tiny Llama on `tpkit.comm.groups(comm, tp, cp)`: converted on its tp group (tp > 1, else the plain model),
    then context-parallel over its cp group."""
    import transformers as tr

    g = tpkit.comm.groups(comm, tp=tp, cp=cp)
    model = tpkit.from_pretrained(directory, comm=g.tp, mode="training", dtype=torch.float64) if tp > 1 else \
        tr.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float64)
    return tpkit.context_parallel(model, g.cp, method=CP_METHOD)


def _cp(directory: str, out: str) -> dict:
    """Context parallelism on 4 ranks: cp2 x tp2, cp4, cp2 x dp2 (DDP, FSDP2), tp2's checkpoint-3 resumed at cp2 x
    tp2, and what is refused."""
    import tpkit.trainer

    comm = tpkit.init()
    res = {}
    for name, (tp, cp, changes) in {"cp2-tp2": (2, 2, {}), "cp4": (1, 4, {}),
                                    "cp2-dp2-ddp": (1, 2, {"per_device_train_batch_size": 2}),
                                    "cp2-dp2-fsdp": (1, 2, {"per_device_train_batch_size": 2,
                                                            "fsdp": "full_shard"}),
                                    "cp2-tp2-own-count": (2, 2, {"average_tokens_across_devices": False,
                                                                 "max_steps": 2, "eval_strategy": "no"})}.items():
        trainer = _trainer(_context_parallel(directory, comm, tp, cp), os.path.join(out, name), **changes)
        trainer.train()
        trainer.save_model()
        res[name] = {"history": trainer.state.log_history, "tokens": trainer.state.num_input_tokens_seen,
                     "methods": {m for m, _ in trainer.train_layout.record.context.methods.values()}}
    resumed = _trainer(_context_parallel(directory, comm, 2, 2), os.path.join(out, "cp-resumed"))
    resumed.train(resume_from_checkpoint=os.path.join(out, "tp2", "checkpoint-3"))
    resumed.save_model()
    res["resumed"] = resumed.state.log_history
    g = tpkit.comm.groups(comm, tp=2, cp=2)
    swapped = lambda: tpkit.context_parallel(  # noqa: E731 - cp innermost: tp {0, 2}, cp {0, 1}
        tpkit.from_pretrained(directory, comm=g.cp, mode="training", dtype=torch.float64), g.tp, method=CP_METHOD)
    said = {}
    for name, make in (("layout", lambda: tpkit.trainer.Trainer(model=swapped(), args=arguments(out))),
                       ("smoothing", lambda: tpkit.trainer.Trainer(
                           model=_context_parallel(directory, comm, 2, 2),
                           args=arguments(out, eval_strategy="no", label_smoothing_factor=0.1)))):
        try:
            make()
            said[name] = "accepted"
        except Exception as exc:  # noqa: BLE001 - the message is the result
            said[name] = f"{type(exc).__name__}: {exc}"
    res["refused"] = said
    return res


def _plain_dp2(directory: str, out: str) -> list:
    """Plain transformers.Trainer's own data parallelism: 2 processes, the unconverted model, 2 rows each."""
    import transformers as tr

    model = tr.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float64)
    trainer = tr.Trainer(model=model, args=arguments(os.path.join(out, "plain-dp2"), per_device_train_batch_size=2),
                         train_dataset=train_rows(), eval_dataset=eval_rows(), compute_metrics=next_token_accuracy)
    trainer.train()
    return trainer.state.log_history


# ----------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def out(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("trainer")
    make_model(str(root / "model"))
    return str(root)


@pytest.fixture(scope="module")
def tp2(out):
    return tpkit.launch(_tp2, 2, args=(os.path.join(out, "model"), out), timeout=400)[0]


@pytest.fixture(scope="module")
def tp3(out, tp2):
    return tpkit.launch(_tp3, 3, args=(os.path.join(out, "model"), out), timeout=400)[0]


@pytest.fixture(scope="module")
def dp(out, tp2):
    return tpkit.launch(_dp, 4, args=(os.path.join(out, "model"), out), timeout=400)[0]


@pytest.fixture(scope="module")
def cp(out, tp2):
    return tpkit.launch(_cp, 4, args=(os.path.join(out, "model"), out), timeout=400)[0]


@pytest.fixture(scope="module")
def plain_dp2(out):
    return tpkit.launch(_plain_dp2, 2, args=(os.path.join(out, "model"), out), timeout=300)[0]


@pytest.fixture(scope="module")
def reference(out):
    """ONE process of plain transformers.Trainer: the run tp2 makes, and the one tp3 makes (its best model)."""
    model = os.path.join(out, "model")
    return {"plain": one_process_trainer(model, os.path.join(out, "ref")).state.log_history,
            "best": one_process_trainer(model, os.path.join(out, "ref-best"), **_BEST).state.log_history}


# ----------------------------------------------------------------------------------------------- tests

def test_tp2_logs_what_one_process_logs(tp2, reference):
    got, want = logged(tp2["history"]), logged(reference["plain"])
    assert not same_figures(got, want, TIGHT), same_figures(got, want, TIGHT)
    assert {k for _, k, _ in got} >= {"loss", "grad_norm", "eval_loss", "eval_accuracy", "eval_perplexity"}
    assert max(v for _, k, v in got if k == "grad_norm") > 0.5  # clipping was active
    assert tp2["tokens"] == STEPS * 4 * 12  # counted once per replica, not once per rank


def test_tp2_save_model_is_the_one_process_directory(tp2, reference, out):
    ours, theirs = state_of(os.path.join(out, "tp2")), state_of(os.path.join(out, "ref", "final"))
    assert ours.keys() == theirs.keys() and max(rel(ours[k], theirs[k]) for k in ours) < 1e-4
    assert {"checkpoint-3", "checkpoint-6", "config.json", "model.safetensors", "training_args.bin",
            "tokenizer.json"} - {"tokenizer.json"} <= set(tp2["listing"])
    assert {"trainer_state.json", "scheduler.pt", "latest", "rng_state_0.pth", "rng_state_1.pth"} <= \
        set(tp2["checkpoint"])  # tpkit's sharded checkpoint beside Trainer's own state files


def test_checkpoint_3_resumes_to_the_uninterrupted_run(tp2, out):
    after = lambda history: [x for x in logged(history) if x[0] > 3]  # noqa: E731 (the state resumed holds 1-3)
    assert after(tp2["resumed"]) and not same_figures(after(tp2["resumed"]), after(tp2["history"]), TIGHT)
    ours, theirs = state_of(os.path.join(out, "tp2-resumed")), state_of(os.path.join(out, "tp2"))
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)  # bit for bit


def test_stock_tools_refuse_a_converted_model(tp2):
    said = tp2["refusals"]
    assert said["trainer"].startswith("SentinelError") and "tpkit.trainer.Trainer" in said["trainer"], said
    assert said["ddp"].startswith("SentinelError") and "tpkit.data_parallel" in said["ddp"], said
    assert said["unchanged"]  # refused before DDP broadcast anything
    assert said["fully_shard"].startswith("SentinelError") and "tpkit.data_parallel" in said["fully_shard"], said


def test_tp3_parallelize_logs_and_keeps_checkpoints_as_one_process(tp3, reference, out):
    got, want = logged(tp3["history"]), logged(reference["best"])
    assert not same_figures(got, want, TIGHT), same_figures(got, want, TIGHT)
    ref_dirs = sorted(d for d in os.listdir(os.path.join(out, "ref-best")) if d.startswith("checkpoint-"))
    assert [d for d in tp3["listing"] if d.startswith("checkpoint-")] == ref_dirs  # save_total_limit
    ours, theirs = state_of(os.path.join(out, "tp3", "final")), state_of(os.path.join(out, "ref-best", "final"))
    assert max(rel(ours[k], theirs[k]) for k in ours) < 1e-4  # the best model, loaded at the end


def test_tp3_lora_trains_and_saves_as_stock_peft(tp3, out):
    import peft
    import transformers as tr

    base = tr.LlamaForCausalLM.from_pretrained(os.path.join(out, "model"), dtype=torch.float64)
    torch.manual_seed(0)
    model = peft.get_peft_model(base, _lora_config())
    trainer = tr.Trainer(model=model, args=arguments(os.path.join(out, "ref-lora")), train_dataset=train_rows(),
                         eval_dataset=eval_rows(), compute_metrics=next_token_accuracy)
    trainer.train()
    trainer.save_model()
    assert not same_figures(logged(tp3["lora"]), logged(trainer.state.log_history), TIGHT)
    from safetensors.torch import load_file

    ours = load_file(os.path.join(out, "tp3-lora", "adapter_model.safetensors"))
    theirs = load_file(os.path.join(out, "ref-lora", "adapter_model.safetensors"))
    assert ours.keys() == theirs.keys() and max(rel(ours[k], theirs[k]) for k in ours) < 1e-4
    with open(os.path.join(out, "tp3-lora", "adapter_config.json")) as f:
        assert json.load(f)["r"] == 4


def test_tp2_dp2_equals_plain_trainers_data_parallelism(dp, plain_dp2, out):
    plain = plain_dp2
    for name in ("ddp", "fsdp"):
        assert not same_figures(logged(dp[name]), logged(plain), TIGHT), (name, same_figures(logged(dp[name]),
                                                                                             logged(plain), TIGHT))
    for name in ("ddp", "fsdp"):
        ours, theirs = state_of(os.path.join(out, f"dp-{name}")), state_of(os.path.join(out, "ref", "final"))
        assert max(rel(ours[k], theirs[k]) for k in ours) < 1e-4, name  # the one-process weights too


@pytest.mark.parametrize("layout", ["tp3", "dp", "cp"])
def test_a_tp2_checkpoint_resumes_at_another_layout(layout, request, tp2, out):
    """At tp3, at tp2 x dp2 (the same global batch) and at cp2 x tp2: the uninterrupted tp2 run's figures and
    weights."""
    res = request.getfixturevalue(layout)
    train = [x for x in logged(res["resumed"]) if x[0] > 3 and x[1] in ("loss", "grad_norm")]
    want = [x for x in logged(tp2["history"]) if x[0] > 3 and x[1] in ("loss", "grad_norm")]
    assert train and not same_figures(train, want, 1e-5), same_figures(train, want, 1e-5)
    ours, theirs = state_of(os.path.join(out, f"{layout}-resumed")), state_of(os.path.join(out, "tp2"))
    assert max(rel(ours[k], theirs[k]) for k in ours) < 1e-4


@pytest.mark.parametrize("name", ["cp2-tp2", "cp4"])
def test_context_parallel_logs_and_saves_what_one_process_does(cp, reference, out, name):
    """Whole rows on every cp rank, the loss the global token mean, the gradients summed over cp: one process's
    figures (the eval metrics read the logits gathered into whole sequences), tokens and weights."""
    got, want = logged(cp[name]["history"]), logged(reference["plain"])
    assert not same_figures(got, want, TIGHT), same_figures(got, want, TIGHT)
    assert {k for _, k, _ in got} >= {"loss", "grad_norm", "eval_loss", "eval_accuracy", "eval_perplexity"}
    flops = lambda history: [h["total_flos"] for h in history if "total_flos" in h]  # noqa: E731
    assert flops(cp[name]["history"]) == flops(reference["plain"])  # counted once per replica, not per rank
    assert cp[name]["tokens"] == STEPS * 4 * 12
    assert cp[name]["methods"] == {"all_to_all"}  # what "auto" picked
    ours, theirs = state_of(os.path.join(out, name)), state_of(os.path.join(out, "ref", "final"))
    assert ours.keys() == theirs.keys() and max(rel(ours[k], theirs[k]) for k in ours) < 1e-4


def test_a_replicas_own_token_count_is_not_divided_by_its_ranks(cp, reference):
    """average_tokens_across_devices=False: transformers divides the count it did not gather by tp x cp anyway."""
    got = [x for x in logged(cp["cp2-tp2-own-count"]["history"]) if x[1] in ("loss", "grad_norm")]
    want = [x for x in logged(reference["plain"]) if x[0] <= 2 and x[1] in ("loss", "grad_norm")]
    assert not same_figures(got, want, TIGHT), same_figures(got, want, TIGHT)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_cp2_dp2_equals_plain_trainers_data_parallelism(cp, plain_dp2, out, mode):
    got = logged(cp[f"cp2-dp2-{mode}"]["history"])
    assert not same_figures(got, logged(plain_dp2), TIGHT), same_figures(got, logged(plain_dp2), TIGHT)
    ours, theirs = state_of(os.path.join(out, f"cp2-dp2-{mode}")), state_of(os.path.join(out, "ref", "final"))
    assert max(rel(ours[k], theirs[k]) for k in ours) < 1e-4


def test_context_parallel_layouts_trainer_cannot_train_are_refused(cp):
    said = cp["refused"]
    assert said["layout"].startswith("TrainerSetupError") and "tpkit.comm.groups(world, tp=2, cp=2)" in \
        said["layout"] and "world[0, 2]" in said["layout"], said  # the group it was given and the fix
    assert said["smoothing"].startswith("TrainerSetupError") and "label_smoothing_factor" in said["smoothing"], said
