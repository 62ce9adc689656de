"""Tiny Hugging Face models for the conversion tests, built locally (no downloads), and the per-rank check bodies
shared by the thread and gloo tests (module level, so spawned processes can import them)."""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

import threading

VOCAB = 103  # odd on purpose: the vocabulary never divides by the world size


def hf_model(name: str, **over) -> nn.Module:
    """A tiny Hugging Face model with no dropout, weights from a fixed seed."""
    import transformers as tr

    common = dict(vocab_size=VOCAB)
    if name in ("llama", "mistral", "qwen2"):
        cls, cfg_cls = {"llama": (tr.LlamaForCausalLM, tr.LlamaConfig), "mistral": (tr.MistralForCausalLM, tr.MistralConfig),
                        "qwen2": (tr.Qwen2ForCausalLM, tr.Qwen2Config)}[name]
        kw = dict(hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=(name == "qwen2"))
    elif name == "gpt2":
        cls, cfg_cls = tr.GPT2LMHeadModel, tr.GPT2Config
        kw = dict(n_embd=48, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                  bos_token_id=0, eos_token_id=0)
    elif name == "bert":
        cls, cfg_cls = tr.BertModel, tr.BertConfig
        kw = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=72,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64)
    elif name == "opt":
        cls, cfg_cls = tr.OPTForCausalLM, tr.OPTConfig
        kw = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, ffn_dim=72, word_embed_proj_dim=48,
                  max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
                  pad_token_id=1)
    elif name == "phi3":  # q, k, v packed in one projection (GQA), gate and up in another
        cls, cfg_cls = tr.Phi3ForCausalLM, tr.Phi3Config
        kw = dict(hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif name == "neox":  # each head's q, k, v side by side: [heads, 3 x head_dim]
        cls, cfg_cls = tr.GPTNeoXForCausalLM, tr.GPTNeoXConfig
        kw = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                  max_position_embeddings=64)
    else:
        raise ValueError(name)
    kw.update(common)
    kw.update(over)
    config = cfg_cls(**kw)
    config._attn_implementation = "eager"
    with _BUILD_LOCK:  # thread-ranks share the global RNG: seed and build atomically
        torch.manual_seed(1234)
        return cls(config)


_BUILD_LOCK = threading.Lock()


MODELS = ("llama", "mistral", "qwen2", "gpt2", "bert", "opt")
DECODERS = ("llama", "mistral", "qwen2", "gpt2", "opt")


def inputs(batch: int = 2, seq: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(2, VOCAB, (batch, seq), generator=g)


def first_output(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def _loss(name: str, out, ids) -> torch.Tensor:
    y = first_output(out)
    if name == "bert":
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
        return (y * w).mean()
    return F.cross_entropy(y[:, :-1].reshape(-1, y.shape[-1]), ids[:, 1:].reshape(-1))


def reference(name: str, **over) -> dict:
    """Single-device logits, weights after one AdamW step, and greedy tokens."""
    ids = inputs()
    logits = first_output(hf_model(name, **over)(input_ids=ids)).detach()
    # The optimizer step runs in fp64: Adam's first step divides each gradient by its own magnitude, so an
    # fp32 rounding difference on a gradient near eps would show up as a full-size update difference.
    model = hf_model(name, **over).double()
    out = model(input_ids=ids)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loss(name, out, ids).backward()
    opt.step()
    after = {n: p.detach() for n, p in model.named_parameters()}
    tokens = None
    if name in DECODERS:
        fresh = hf_model(name, **over).eval()
        tokens = fresh.generate(ids[:1, :4], max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0)
    return {"logits": logits, "after": after, "tokens": tokens}


def rank_check(name: str, ref: dict, over: dict | None = None) -> dict:
    """On one rank: convert, compare logits, take one AdamW step and compare every shard, generate."""
    import tpkit
    from tpkit.convert import parallelize

    over = over or {}
    comm = tpkit.get_communicator()
    ids = inputs()
    logits = first_output(parallelize(hf_model(name, **over), comm=comm)(input_ids=ids))
    logit_err = ((logits.detach() - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
    model = parallelize(hf_model(name, **over).double(), comm=comm)
    out = model(input_ids=ids)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loss(name, out, ids).backward()
    opt.step()
    step_err, worst = 0.0, None
    layouts = tpkit.shard_layouts(model)
    for n, p in model.named_parameters():
        want = layouts[n].shard(ref["after"][n])
        # Relative to the tensor's scale, floored at the step size lr: some gradients are exactly zero in
        # theory (a key bias shifts all scores of a query equally), so their update is rounding noise.
        err = ((p.detach() - want).abs().max() / want.abs().max().clamp_min(1e-2)).item()
        if err > step_err:
            step_err, worst = err, n
    same_tokens = None
    if ref["tokens"] is not None:
        fresh = parallelize(hf_model(name, **over).eval(), comm=comm)
        tokens = fresh.generate(ids[:1, :4], max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0)
        same_tokens = bool(torch.equal(tokens, ref["tokens"]))
    return {"logit_err": logit_err, "step_err": step_err, "worst": worst, "same_tokens": same_tokens}


def gloo_body(names, refs):
    return {n: rank_check(n, refs[n]) for n in names}
