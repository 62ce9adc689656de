"""The traced activation estimate against the bytes a real CPU forward saves for backward.

The measurement: a real forward of the model (converted for each rank by `parallelize` on thread-ranks at world
size 2) under `torch.autograd.graph.saved_tensors_hooks`, counting each storage once and no parameter or buffer.
The estimate never runs the model on data: it traces a weightless copy on fake tensors (`traced.py`).
"""
from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
from torch import nn

import tpkit
from tpkit.comm import run_threads
from tpkit.estimate import estimate_memory, optimizer_bytes_per_parameter
from tpkit.comm.shapes import ShapeCommunicator
from tpkit.estimate.fake_step import saved_bytes
from tpkit.estimate.traced import trace_rank

transformers = pytest.importorskip("transformers")
V = 100


def _model(family: str, attn: str = "sdpa"):
    """Five block shapes: GQA SwiGLU + RMSNorm, GPT-2 (Conv1D, GeLU, dropout on), GPT-NeoX (interleaved qkv,
    parallel residual), BERT (post-norm encoder), OPT (ReLU MLP)."""
    import transformers as tr

    if family == "llama":
        cfg = tr.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                             num_key_value_heads=4, vocab_size=V)
        cls = tr.LlamaForCausalLM
    elif family == "gpt2":
        cfg = tr.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=V, resid_pdrop=0.1,
                            embd_pdrop=0.1, attn_pdrop=0.1)
        cls = tr.GPT2LMHeadModel
    elif family == "neox":
        cfg = tr.GPTNeoXConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                               vocab_size=V, max_position_embeddings=64)
        cls = tr.GPTNeoXForCausalLM
    elif family == "bert":
        cfg = tr.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            vocab_size=V, max_position_embeddings=64)
        cls = tr.BertModel
    else:
        cfg = tr.OPTConfig(hidden_size=64, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64,
                           max_position_embeddings=64, num_hidden_layers=2, vocab_size=V)
        cls = tr.OPTForCausalLM
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return cls(cfg).train()


def _measure(base: nn.Module, world_size: int, ids: torch.Tensor) -> list[tuple[int, int]]:
    """(saved bytes, local parameters) of a real forward on every rank of the converted model."""
    def body(comm):
        model = copy.deepcopy(base)
        if comm.world_size > 1:
            tpkit.parallelize(model, comm=comm, mode="training")
        kwargs = {"input_ids": ids}
        if "labels" in inspect.signature(model.forward).parameters:
            kwargs["labels"] = ids
        return saved_bytes(model, (), kwargs), sum(p.numel() for p in model.parameters())
    return run_threads(body, world_size)


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "eager"),
                                         ("neox", "sdpa"), ("bert", "sdpa"), ("opt", "eager")])
@pytest.mark.parametrize("t", [1, 2])
def test_traced_activations_match_saved_tensors(family, attn, t):
    base = _model(family, attn)
    ids = torch.randint(0, V, (2, 16))
    real = _measure(base, t, ids)
    saved, params = max(real)
    est = estimate_memory(base, t, dtype=torch.float32, mode="training", batch_size=2, seq_len=16)
    assert est.activation_method == "traced"
    assert est.per_rank.activations == pytest.approx(saved, rel=0.10)
    assert est.per_rank.activations == saved  # in fact exact: the same ops, counted the same way
    assert est.parameters_per_rank == params
    assert est.per_rank.parameters == params * 4 and est.per_rank.gradients == params * 4
    assert est.per_rank.optimizer_states == params * optimizer_bytes_per_parameter("adamw", torch.float32)
    # A config alone (built with 1 and 2 layers, extrapolated) gives the same figure.
    by_config = estimate_memory(base.config, t, dtype=torch.float32, mode="training", batch_size=2, seq_len=16)
    if family != "bert":  # a BertConfig builds BertForMaskedLM, another model than this BertModel
        assert by_config.per_rank.activations == saved
        assert by_config.activations_per_layer is not None and by_config.activations_per_layer > 0


def test_traced_sequence_parallel_matches_saved_tensors():
    """With sequence parallelism the trace follows the converter's own region (what it keeps whole, such as the
    gathered input of the column layers, and what it splits), so it equals the real rank's bytes."""
    base = _model("llama")
    ids = torch.randint(0, V, (2, 16))

    def body(comm):
        model = tpkit.parallelize(copy.deepcopy(base), comm=comm, mode="training", sequence_parallel=True)
        return saved_bytes(model, (), {"input_ids": ids, "labels": ids})
    saved = max(run_threads(body, 2))
    est = estimate_memory(base, 2, dtype=torch.float32, mode="training", batch_size=2, seq_len=16,
                          sequence_parallel=True)
    plain = estimate_memory(base, 2, dtype=torch.float32, mode="training", batch_size=2, seq_len=16)
    assert est.per_rank.activations == saved < plain.per_rank.activations


def _gloo_rank(family: str, attn: str, ids: torch.Tensor) -> int:
    """One gloo process: the same seeded model on every rank, converted, one real forward measured."""
    model = _model(family, attn)
    tpkit.parallelize(model, mode="training")
    return saved_bytes(model, (), {"input_ids": ids, "labels": ids})


@pytest.mark.slow
def test_traced_activations_match_two_gloo_processes():
    ids = torch.randint(0, V, (2, 16))
    saved = max(tpkit.launch(_gloo_rank, 2, backend="gloo", args=("neox", "sdpa", ids)))
    est = estimate_memory(_model("neox"), 2, dtype=torch.float32, mode="training", batch_size=2, seq_len=16)
    assert est.per_rank.activations == saved


@pytest.mark.parametrize("t", [1, 2])
def test_traced_cnn_matches_saved_tensors(t):
    """A sixth shape with no config: convolutions column -> row, then an MLP head."""
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1), nn.ReLU(),
                        nn.Flatten(), nn.Linear(8 * 8 * 8, 32), nn.GELU(), nn.Linear(32, 10))
    x = torch.randn(4, 3, 8, 8)

    def body(comm):
        model = copy.deepcopy(cnn).train()
        if comm.world_size > 1:
            tpkit.parallelize(model, comm=comm, mode="training", example_inputs=(x,))
        return saved_bytes(model, (x,)), sum(p.numel() for p in model.parameters())
    saved, params = max(run_threads(body, t))
    est = estimate_memory(cnn, t, dtype=torch.float32, mode="training", batch_size=8, example_input=x)
    assert est.activation_method == "traced"
    assert est.per_rank.activations == pytest.approx(2 * saved, rel=0.10)  # batch 8 = 2 x the example's 4
    assert est.parameters_per_rank == params


def test_config_extrapolates_layers_exactly():
    """Per layer x L + outside: tracing 1 and 2 layers of a 5-layer config equals the 5-layer model's bytes."""
    import transformers as tr

    cfg = tr.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=V)
    whole = trace_rank(cfg, 2, 1, torch.bfloat16, 2, 16, whole=True)
    parts = trace_rank(cfg, 2, 1, torch.bfloat16, 2, 16)
    assert parts.layers == (1, 2) and whole.layers == (0, 0)
    assert parts.activations == whole.activations and parts.parameters() == whole.parameters()
    assert parts.per_layer > 0 and whole.per_layer is None


def test_fake_trace_does_not_touch_the_model():
    base = _model("llama")
    before = {k: v.clone() for k, v in base.state_dict().items()}
    estimate_memory(base, 2, dtype=torch.float32, mode="training", batch_size=1, seq_len=8)
    assert all(torch.equal(before[k], v) for k, v in base.state_dict().items())
    assert all(p.grad is None for p in base.parameters())


def test_shape_only_communicator_shapes():
    comm = ShapeCommunicator(1, 4)
    x = torch.zeros(3, 5)
    assert comm.all_reduce(x).shape == (3, 5)
    assert comm.all_gather(x, dim=1).shape == (3, 20)
    assert comm.reduce_scatter(torch.zeros(10, 2), dim=0).shape == (3, 2)  # split_sizes(10, 4)[1] == 3
    with pytest.raises(ValueError, match="rank 4 outside world size 4"):
        ShapeCommunicator(4, 4)


# ------------------------------------------------------------------------------------ 2-D (TP x DP)


def _fsdp_rows(shapes, dp):
    return sum(-(-s[0] // dp) * math.prod(s[1:]) for s in shapes)


@pytest.mark.parametrize("dp", [2, 3])
def test_fsdp_divides_each_local_tensor_along_dim0(dp):
    base = _model("llama")
    shapes = run_threads(lambda comm: [tuple(p.shape) for p in tpkit.parallelize(copy.deepcopy(base), comm=comm,
                                                                                  mode="training").parameters()], 2)
    want = max(_fsdp_rows(s, dp) for s in shapes)
    plain = estimate_memory(base, 2, dtype=torch.bfloat16, mode="training", batch_size=2, seq_len=16)
    fsdp = estimate_memory(base, 2, dtype=torch.bfloat16, mode="training", batch_size=2, seq_len=16, dp_size=dp,
                           dp_mode="fsdp")
    assert fsdp.parameters_per_rank == want
    assert fsdp.per_rank.parameters == want * 2 and fsdp.per_rank.gradients == want * 2
    assert fsdp.per_rank.optimizer_states == want * 12  # bf16: fp32 master + two fp32 moments
    assert plain.parameters_per_rank / dp <= want < plain.parameters_per_rank  # padded shards
    assert fsdp.per_rank.activations == plain.per_rank.activations  # the local micro-batch
    assert fsdp.dp_size == dp and fsdp.dp_mode == "fsdp" and fsdp.to_dict()["dp_mode"] == "fsdp"


def test_ddp_replicates():
    base = _model("gpt2")
    plain = estimate_memory(base, 2, dtype=torch.float32, mode="training", batch_size=2, seq_len=16)
    ddp = estimate_memory(base, 2, dtype=torch.float32, mode="training", batch_size=2, seq_len=16, dp_size=4,
                          dp_mode="ddp")
    assert ddp.per_rank.to_dict() == plain.per_rank.to_dict()
    assert ddp.dp_size == 4 and any("ddp over 4" in n for n in ddp.notes)


def test_fsdp_of_a_plain_module_and_bad_dp_arguments():
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    est = estimate_memory(mlp, 2, dtype=torch.float32, mode="training", input_shape=(4, 16), dp_size=3,
                          dp_mode="fsdp")
    # rank 0 of TP 2: w1 (32, 16), b1 (32,), w2 (16, 32), b2 (16,); FSDP 3: ceil(rows / 3) rows each.
    assert est.parameters_per_rank == 11 * 16 + 11 + 6 * 32 + 6
    with pytest.raises(ValueError, match="needs dp_mode"):
        estimate_memory(mlp, 2, input_shape=(4, 16), dp_size=2)
    with pytest.raises(ValueError, match="dp_mode must be"):
        estimate_memory(mlp, 2, input_shape=(4, 16), dp_size=2, dp_mode="zero3")
    with pytest.raises(ValueError, match="dp_size must be a positive int"):
        estimate_memory(mlp, 2, input_shape=(4, 16), dp_size=0, dp_mode="ddp")


def test_a_training_trace_records_each_collective_of_its_step_once():
    """A Llama layer at TP 2 adds 2 all-reduces to a training forward (attention and MLP outputs) and 5 to the
    backward (the q, k, v, gate and up layers' input gradients), each once: a second pass of the step (as the trace
    once ran for the peak memory) must not count them again."""
    import collections

    import transformers as tr

    from tpkit.estimate.fake_step import trace_step

    def counts(layers):
        config = tr.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                num_attention_heads=4, num_key_value_heads=4)
        with torch.device("meta"):
            model = tr.LlamaForCausalLM(config)
        return collections.Counter(c.phase for c in trace_step(model, "train", 2, 0, 2, 16).collectives)

    one, two = counts(1), counts(2)
    assert two["forward"] - one["forward"] == 2 and two["backward"] - one["backward"] == 5, (one, two)


def test_a_training_trace_runs_the_forward_once_and_holds_the_steady_peak():
    """One traced training step runs the model's forward once (saved bytes and peak counted in the same pass; two
    passes were a third of a search's time), records AdamW's step without the states' making, and its peak counts
    the states from the start: weights, gradients and two states per weight at least."""
    from tpkit.estimate.fake_step import trace_step

    class Counted(nn.Module):
        calls = 0

        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x):
            Counted.calls += 1
            return self.down(torch.relu(self.up(x)))

    with torch.device("meta"):
        model = Counted()
    weights = sum(p.numel() * 4 for p in model.parameters())
    trace = trace_step(model, "train", example=torch.zeros(8, 16))
    assert Counted.calls == 1
    optimizer = [op.name for op in trace.ops if op.phase == "optimizer"]
    assert "zeros_like" not in optimizer and "zero_" not in optimizer and optimizer.count("lerp_") == 4, optimizer
    assert trace.peak_bytes >= 4 * weights and trace.saved_bytes > 0
