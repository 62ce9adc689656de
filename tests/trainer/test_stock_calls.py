"""Stock calls on a converted model at 2 and 3 thread-ranks, each against one process of plain transformers (float64,
8 heads / 4 KV heads, a vocabulary that splits unevenly): each gives the one-process result or an error naming
tpkit's way, before anything changes.

- `outputs.logits` of a training-mode model reads as the full logits (values, shape, a global `argmax`), and a
  user's own cross-entropy on them trains exactly; the model's own loss never gathers them;
- `generate` on a training-mode model gives one process's tokens (greedy and beam search);
- `output_attentions=True`: every head, in global order;
- `num_parameters()` counts the whole model; `save_pretrained` (every rank) writes the directory one process writes;
  `resize_token_embeddings` is refused naming the way;
- torch's `clip_grad_norm_` (each rank's local norm) is caught by the forward sentinel within 50 steps; inputs that
  differ across the ranks are caught at the first forward; `check_replicas` sees slices a broadcast overwrote;
- `tpkit.from_pretrained` takes transformers' keywords (`attn_implementation`, config attributes) and refuses the
  ones it cannot honour; `consolidate(overwrite=True)` refuses a directory holding a Trainer's checkpoints."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import tpkit
from tests.trainer.common import VOCAB, make_model, rel
from tpkit.comm import run_threads


def llama(vocab: int = VOCAB):
    import transformers as tr

    config = tr.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                            initializer_range=0.2, attn_implementation="eager")
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(config).double()


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def base():
    return llama()


@pytest.mark.parametrize("world", [2, 3])
def test_logits_read_whole_and_train_exactly(base, world):
    tokens = ids()
    ref = copy.deepcopy(base)
    out = ref(input_ids=tokens, output_attentions=True)
    F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
    copies = [copy.deepcopy(base) for _ in range(world)]

    def body(comm):
        model = tpkit.parallelize(copies[comm.rank], comm=comm, mode="training")
        got = model(input_ids=tokens, output_attentions=True)
        logits = got.logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        q = model.model.layers[0].self_attn.q_proj.weight.grad
        return (tuple(logits.shape), logits.detach().clone().full(), logits.argmax(-1), got.attentions,
                loss.detach(), q, model.num_parameters(), model.num_parameters(exclude_embeddings=True))

    results = run_threads(body, world)
    heads = [r[5].shape[0] for r in results]
    for rank, (shape, full, argmax, attentions, loss, q, n, n_body) in enumerate(results):
        assert shape == (2, 9, VOCAB) and rel(full, out.logits) < 1e-12
        assert torch.equal(argmax, out.logits.argmax(-1))  # global indices, never a rank's local ones
        assert len(attentions) == 2 and all(a.shape == b.shape and rel(a, b) < 1e-12
                                            for a, b in zip(attentions, out.attentions))
        assert rel(loss, F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))) < 1e-12
        start = sum(heads[:rank])
        assert rel(q, ref.model.layers[0].self_attn.q_proj.weight.grad[start:start + heads[rank]]) < 1e-10
        assert (n, n_body) == (base.num_parameters(), base.num_parameters(exclude_embeddings=True))


@pytest.mark.parametrize("world", [2, 3])
def test_generate_on_a_training_mode_model(base, world):
    prompt = ids(3)[:, :4]
    greedy = base.generate(prompt, max_new_tokens=6, do_sample=False)
    beams = base.generate(prompt, max_new_tokens=6, do_sample=False, num_beams=3)
    copies = [copy.deepcopy(base) for _ in range(world)]

    def body(comm):
        model = tpkit.parallelize(copies[comm.rank], comm=comm, mode="training")
        return (model.generate(prompt, max_new_tokens=6, do_sample=False),
                model.generate(prompt, max_new_tokens=6, do_sample=False, num_beams=3))

    for g, b in run_threads(body, world):
        assert torch.equal(g, greedy) and torch.equal(b, beams)


@pytest.mark.parametrize("world", [2, 3])
def test_save_pretrained_writes_the_whole_model_and_resize_is_refused(base, world, tmp_path):
    import transformers as tr

    copies = [copy.deepcopy(base) for _ in range(world)]

    def body(comm):
        model = tpkit.parallelize(copies[comm.rank], comm=comm, mode="training")
        model.save_pretrained(str(tmp_path / "saved"))  # every rank: collective
        with pytest.raises(NotImplementedError, match="resize_token_embeddings.*tpkit.parallelize"):
            model.resize_token_embeddings(VOCAB + 3)
        return model.model.embed_tokens.weight.shape[0]

    assert sum(run_threads(body, world)) == VOCAB  # the embedding left as it was
    back = tr.LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float64).state_dict()
    want = base.state_dict()
    assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)


def test_torch_clip_grad_norm_is_caught_within_50_steps(base):
    """torch's clip sees each rank's own slices: the ranks scale by different factors and the replicated norm
    weights drift apart after the first clipped step; the sentinel's check at training forward 50 names the cause."""
    copies = [copy.deepcopy(base) for _ in range(2)]
    tokens = ids()

    def body(comm):
        model = tpkit.parallelize(copies[comm.rank], comm=comm, mode="training").train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        for step in range(60):
            try:
                model(input_ids=tokens, labels=tokens).loss.backward()
            except tpkit.nn.SentinelError as exc:
                return step + 1, str(exc)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            opt.zero_grad()
        return None, ""

    for step, message in run_threads(body, 2):
        assert step == 50 and "clip_grad_norm_" in message and "tpkit.clip_grad_norm_" in message, (step, message)


def test_ranks_given_different_inputs_are_stopped_at_the_first_forward(base):
    copies = [copy.deepcopy(base) for _ in range(2)]

    def body(comm):
        model = tpkit.parallelize(copies[comm.rank], comm=comm, mode="training")
        with pytest.raises(tpkit.nn.SentinelError, match="different inputs .*input_ids.*tpkit.trainer.Trainer"):
            model(input_ids=ids(10 + comm.rank))
        return True

    assert all(run_threads(body, 2))


def test_check_replicas_sees_slices_a_broadcast_overwrote():
    even = llama(vocab=96)  # every split even: rank 0's slices fit rank 1's tensors, as DDP's broadcast copies them
    copies = [copy.deepcopy(even) for _ in range(2)]

    def body(comm):
        model = tpkit.parallelize(copies[comm.rank], comm=comm, mode="training")
        clean = tpkit.check_replicas(model, grads=False).tensors
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(comm.broadcast(p.detach(), src=0))
        with pytest.raises(tpkit.ReplicaError, match="overwritten by a broadcast"):
            tpkit.check_replicas(model, grads=False)
        return clean

    assert all(n > 0 for n in run_threads(body, 2))


def test_from_pretrained_takes_transformers_keywords(tmp_path):
    directory = make_model(str(tmp_path / "model"))

    def body(comm):
        model = tpkit.from_pretrained(directory, comm=comm, attn_implementation="eager", use_cache=False,
                                      local_files_only=True)
        with pytest.raises(ValueError, match="device_map= is not supported .*device="):
            tpkit.from_pretrained(directory, comm=comm, device_map="auto")
        with pytest.raises(TypeError, match="unexpected keyword argument.*no_such_option"):
            tpkit.from_pretrained(directory, comm=comm, no_such_option=1)
        return model.config._attn_implementation, model.config.use_cache

    assert run_threads(body, 2) == [("eager", False)] * 2


def test_consolidate_overwrite_spares_a_trainers_output_dir(tmp_path):
    model = llama()
    out = tmp_path / "run"
    os.makedirs(out / "checkpoint-3")
    (out / "config.json").write_text("{}")

    def body(comm):
        tpkit.save_sharded(tpkit.parallelize(copy.deepcopy(model), comm=comm), str(tmp_path / "ckpt"), comm=comm)

    run_threads(body, 2)
    with pytest.raises(tpkit.CheckpointError, match="checkpoint-3.*would delete them"):
        tpkit.consolidate(str(tmp_path / "ckpt"), str(out), overwrite=True)
    assert sorted(os.listdir(out)) == ["checkpoint-3", "config.json"]


def test_tuple_outputs_read_whole_too(base):
    """return_dict=False: transformers' tuple (loss, logits, ...) carries the same full logits."""
    tokens = ids()
    want = base(input_ids=tokens, labels=tokens, return_dict=False)
    copies = [copy.deepcopy(base) for _ in range(2)]

    def body(comm):
        out = tpkit.parallelize(copies[comm.rank], comm=comm, mode="training")(input_ids=tokens, labels=tokens,
                                                                                return_dict=False)
        return out[0].detach(), out[1].detach().full()

    for loss, logits in run_threads(body, 2):
        assert rel(loss, want[0]) < 1e-12 and rel(logits, want[1]) < 1e-12
