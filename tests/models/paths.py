"""Every way a model reaches training, each checked against ONE process of plain transformers + torch.

For a tiny architecture (float64, SDPA attention: eager attention's float32 softmax would leave ~1e-7), the
reference is one process: a float64 cross-entropy of the logits, one backward, one AdamW step (and, for the
resume path, a second step after a save). On every rank of every entry path the gradient and the updated
parameter must equal the reference's, sliced by `tpkit.shard_layouts`. No path is compared with another
tpkit path: two paths that agree can both be wrong (the lost gradient sums of the meta path were exactly that).

Entry paths (`PATHS`):
- `parallelize`: a real model converted in place;
- `meta+load_sharded`: built on meta, converted, weights read by `load_sharded` from the Hugging Face directory;
- `from_pretrained`, `from_pretrained(device=)`: tpkit's loader, the second with an explicit device;
- `apply_setup`: the search's best tensor-parallel setup for training, applied (training mode: the logits stay
  split over the vocabulary, the loss is `vocab_parallel_cross_entropy`);
- `checkpointer_resume`: built on meta and converted, an optimizer made, then `Checkpointer.resume` from a
  version one process saved after step 1 (parameters and AdamW state resharded from 1 to N ranks); step 2 is
  compared with the reference's step 2;
- `assign+deepcopy+torch.save`: converted, then every path that replaces its Parameters or copies it, one after
  the other: `load_state_dict(assign=True)` (then `tie_weights()`, as transformers re-ties after a load),
  `copy.deepcopy`, `torch.save` / `torch.load` of the whole module.

Module level, so `bench/training_paths.py` prints the same table (before / after figures for the notes).
"""
from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import threading
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import tpkit

VOCAB = 103
LR = 1e-2
_LOCK = threading.Lock()
_DEC = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=64)


def _build(cfg_name: str, cls_name: str, attn: str = "sdpa", after: Callable[[nn.Module], None] | None = None,
           **kw) -> nn.Module:
    import transformers as tr

    config = getattr(tr, cfg_name)(**kw)
    config._attn_implementation = attn
    config._experts_implementation = "eager"  # grouped_mm has no float64 kernel on the CPU
    with _LOCK:  # thread-ranks share torch's global RNG
        torch.manual_seed(1234)
        model = getattr(tr, cls_name)(config)
        if after is not None:
            after(model)
    return model.double()


def _spread_routers(model: nn.Module) -> None:
    """HF initialises routers to tiny values: give them a real spread so routing differs per token."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") or "experts" in name:
                p.normal_(0, 0.3)


def _spread_norms(model: nn.Module) -> None:
    """Per-head norms start as ones (all alike, hiding which head gets which): give each its own weights."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm.norms" in name:
                p.normal_(1, 0.3)


ARCHS: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: _build("LlamaConfig", "LlamaForCausalLM", **_DEC),
    "qwen2_tied": lambda: _build("Qwen2Config", "Qwen2ForCausalLM", **_DEC, tie_word_embeddings=True),
    "phi3": lambda: _build("Phi3Config", "Phi3ForCausalLM", **_DEC, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "starcoder2": lambda: _build("Starcoder2Config", "Starcoder2ForCausalLM", **_DEC, residual_dropout=0.0,
                                 embedding_dropout=0.0, attention_dropout=0.0),
    "qwen3": lambda: _build("Qwen3Config", "Qwen3ForCausalLM", **_DEC, head_dim=8),
    "gemma3": lambda: _build("Gemma3TextConfig", "Gemma3ForCausalLM", **_DEC, head_dim=8, sliding_window=4,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "olmo2": lambda: _build("Olmo2Config", "Olmo2ForCausalLM", **_DEC, pad_token_id=0),
    "falcon_mq": lambda: _build("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=64,
                                num_hidden_layers=2, num_attention_heads=8, multi_query=True,
                                new_decoder_architecture=False, hidden_dropout=0.0, attention_dropout=0.0, bias=False),
    "gpt_bigcode_mq": lambda: _build("GPTBigCodeConfig", "GPTBigCodeForCausalLM", vocab_size=VOCAB, n_embd=48,
                                     n_layer=2, n_head=6, n_positions=64, multi_query=True, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0),
    "stablelm_qk_norm": lambda: _build("StableLmConfig", "StableLmForCausalLM", after=_spread_norms,
                                       **dict(_DEC, num_key_value_heads=8), qk_layernorm=True,
                                       partial_rotary_factor=0.5, hidden_dropout=0.0, attention_dropout=0.0),
    "gpt2": lambda: _build("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4,
                           n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                           eos_token_id=0),
    "neox": lambda: _build("GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=VOCAB, hidden_size=48,
                           intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                           max_position_embeddings=64),
    "opt": lambda: _build("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2,
                          num_attention_heads=4, ffn_dim=72, word_embed_proj_dim=48, max_position_embeddings=64,
                          dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1),
    "mixtral": lambda: _build("MixtralConfig", "MixtralForCausalLM", attn="sdpa", after=_spread_routers,
                              **dict(_DEC, hidden_size=48, intermediate_size=48), num_local_experts=4,
                              num_experts_per_tok=2, router_jitter_noise=0.0),
    "deepseek_v3": lambda: _build("DeepseekV3Config", "DeepseekV3ForCausalLM", after=_spread_routers,
                                  vocab_size=VOCAB, hidden_size=48, intermediate_size=96, moe_intermediate_size=24,
                                  num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6,
                                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                  first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64),
}

#: A model whose own forward computes below float64 in a float64 model leaves ~1e-7 relative differences on any
#: reordering of sums (a gradient summed over two ranks is rounded twice where one process rounds it once), and
#: AdamW's first step, about lr * sign(gradient), turns those into larger ones on near-zero gradients: routers
#: with a float32 softmax or sigmoid (Mixtral, DeepSeek-V3), RMSNorms cast to float32 on heads that ranks share
#: (Qwen3, Gemma 3 and OLMo-2's q_norm / k_norm). A lost gradient sum is an error of 0.3 to 2, far above these.
TOLERANCE = {"mixtral": 1e-3, "deepseek_v3": 1e-3, "qwen3": 1e-3, "gemma3": 1e-3, "olmo2": 1e-3}
DEFAULT_TOL = 1e-9


PATHS = ("parallelize", "meta+load_sharded", "from_pretrained", "from_pretrained(device=)", "apply_setup",
         "checkpointer_resume", "assign+deepcopy+torch.save")


def ids() -> torch.Tensor:
    """Batch 2 x 6 tokens: 6 divides by 2 and 3, as sequence parallelism (a setup the search may pick) needs."""
    return torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))


def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in the logits' dtype (float64); from a vocabulary slice when they are split."""
    x, y = logits[:, :-1], tokens[:, 1:]
    if isinstance(logits, tpkit.nn.SplitLogits):  # training mode: computed on this rank's slice, never gathered
        return tpkit.nn.vocab_parallel_cross_entropy(x, y, vocab_size=VOCAB)
    return F.cross_entropy(x.reshape(-1, VOCAB), y.reshape(-1))


def _step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    opt.zero_grad(set_to_none=True)
    loss_of(model(input_ids=tokens).logits, tokens).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    return grads


def reference(base: nn.Module, directory: str) -> dict:
    """One process: step 1's gradients and parameters, a Checkpointer version of step 1 (world size 1) under
    `directory/ckpt`, the base saved by `save_pretrained` under `directory/hf`, then step 2's."""
    model = copy.deepcopy(base).train()
    hf = os.path.join(directory, "hf")
    model.save_pretrained(hf)
    _keep_experts_eager(hf)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens = ids()
    out = {"grads1": _step(model, opt, tokens), "after1": _params(model)}
    tpkit.Checkpointer(os.path.join(directory, "ckpt"), every=1).save(1, model, opt)
    out.update(grads2=_step(model, opt, tokens), after2=_params(model))
    return out


def _keep_experts_eager(hf: str) -> None:
    """transformers' default MoE kernel (grouped_mm) has no float64 CPU version; the saved config asks for its
    eager experts, as a user of float64 would (`experts_implementation` is a config argument)."""
    path = os.path.join(hf, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["experts_implementation"] = "eager"
    with open(path, "w") as f:
        json.dump(config, f)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _meta_model(base: nn.Module) -> nn.Module:
    """The architecture built on meta as a user builds it (then cast to the checkpoint's float64)."""
    with torch.device("meta"):
        model = type(base)(copy.deepcopy(base.config))
    return model.to(torch.float64)


def tp_setup(base: nn.Module, world: int):
    """The search's best training setup that is tensor parallel over all `world` ranks (searched once, in one
    process, as a user does before launching)."""
    found = tpkit.search(base, world, goal="train", batch_size=2, seq_len=6)
    return next(c for c in found.candidates if c.setup.tp == world and c.setup.dp == 1)


def setup_at(candidate, world: int):
    """`candidate`'s setup (its families' choices, sequence parallelism, recompute) at `world` tensor-parallel ranks,
    without its plan: `apply_setup` plans it for that size, as it does for a candidate the search did not rank
    first (`propose` with the setup's choices)."""
    return dataclasses.replace(candidate.setup, tp=world, dp=1, dp_mode=None)


def reach(path: str, base: nn.Module, directory: str, comm, setup=None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (and its optimizer) as a user's script has it when training starts by `path` (`setup`: the
    search's candidate, for "apply_setup")."""
    hf = os.path.join(directory, "hf")
    if path == "parallelize":
        model = tpkit.parallelize(copy.deepcopy(base), comm=comm)
    elif path == "meta+load_sharded":
        model = tpkit.parallelize(_meta_model(base), comm=comm)
        tpkit.load_sharded(model, hf, comm=comm)
    elif path == "from_pretrained":
        model = tpkit.from_pretrained(hf, comm=comm, dtype=torch.float64)
    elif path == "from_pretrained(device=)":
        model = tpkit.from_pretrained(hf, comm=comm, dtype=torch.float64, device="cpu")
    elif path == "apply_setup":
        model = tpkit.apply_setup(copy.deepcopy(base), setup, comm)
    elif path == "assign+deepcopy+torch.save":
        model = tpkit.parallelize(copy.deepcopy(base), comm=comm)
        clones: dict[int, torch.Tensor] = {}  # a tensor two keys share stays one (as a state dict read from a file)
        model.load_state_dict({k: clones.setdefault(id(v), v.detach().clone()) for k, v in model.state_dict().items()},
                              assign=True)
        model.tie_weights()  # assign=True gives each key its own Parameter: tied ones are tied again, as transformers
        buffer = io.BytesIO()  # does after its own loads
        torch.save(copy.deepcopy(model), buffer)
        buffer.seek(0)
        model = torch.load(buffer, weights_only=False)
    elif path == "checkpointer_resume":
        model = tpkit.parallelize(_meta_model(base), comm=comm)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        step = tpkit.Checkpointer(os.path.join(directory, "ckpt"), every=1, comm=comm).resume(model, opt)
        assert step == 1, step
        return model.train(), opt
    else:
        raise ValueError(path)
    return model.train(), torch.optim.AdamW(model.parameters(), lr=LR)


def _rel(got: torch.Tensor | None, want: torch.Tensor, floor: float) -> float:
    if got is None or got.shape != want.shape:
        return float("inf")
    scale = max(want.abs().max().item(), floor)
    return (got.detach() - want).abs().max().item() / scale


def rank_errors(base: nn.Module, directory: str, ref: dict, paths=PATHS, setup=None) -> dict[str, dict]:
    """On one rank: per entry path, the worst relative error of a gradient and of an updated parameter against
    the reference's slice, with the key where each occurs."""
    comm = tpkit.get_communicator()
    out = {}
    for path in paths:
        model, opt = reach(path, base, directory, comm, setup)
        second = path == "checkpointer_resume"
        grads = _step(model, opt, ids())
        want_g, want_p = (ref["grads2"], ref["after2"]) if second else (ref["grads1"], ref["after1"])
        layouts = tpkit.shard_layouts(model)
        top = max(g.abs().max().item() for g in want_g.values())
        worst = {"grad": (0.0, ""), "param": (0.0, "")}
        for n, p in model.named_parameters():
            key = n.removeprefix("module.")
            if key not in want_g:
                continue
            e = _rel(grads.get(n), layouts[n].shard(want_g[key]), 1e-3 * top)
            worst["grad"] = max(worst["grad"], (e, key))
            e = _rel(p, layouts[n].shard(want_p[key]), LR)
            worst["param"] = max(worst["param"], (e, key))
        out[path] = worst
    return out


def prepare(name: str, directory: str) -> tuple[nn.Module, dict]:
    """Architecture `name` built once, and its one-process reference (files under `directory`)."""
    import transformers

    transformers.AutoConfig, transformers.AutoModelForCausalLM  # resolve its lazy names before ranks race  # noqa: B018
    base = ARCHS[name]()
    return base, reference(base, directory)


def run(base: nn.Module, ref: dict, world: int, directory: str, paths=PATHS,
        backend: str = "threads", setup=None) -> list[dict]:
    """Every rank's `rank_errors` at `world` ranks (`setup` for "apply_setup": default, the search's, `tp_setup`)."""
    if setup is None and "apply_setup" in paths:
        setup = tp_setup(base, world)
    return tpkit.launch(rank_errors, world, backend=backend, args=(base, directory, ref, paths, setup))
