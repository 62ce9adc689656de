"""The framework's own time per module, measured: what a step costs beyond its kernels and collectives when the
model is a transformers model run the way users run it (`generate` for decoding; forward, backward and AdamW for
training).

Why a term of its own: at small widths a step is mostly Python (the decoder layer's modules, `generate`'s loop,
the optimizer's per-tensor work), not arithmetic, and a rate measured on one large kernel says nothing of it:
a 3-layer Qwen2 at hidden 384 was predicted 3x too fast from kernels alone. So the calibration runs a tiny
model of each family (hidden 64: its kernels cost next to nothing) with 1 and with 3 decoder layers, times it,
subtracts what its kernels and collectives take at the measured rates, and splits the rest into

* `layer_s`: one decoder layer's forward (decode) or forward + backward (training), the difference per layer;
* `step_s`: everything else of a step: embedding, final norm, LM head and loss, `generate`'s per-token work;
* decoding only, `row_s` and `logit_s`: what each further batch row and each further logit (row x vocabulary
  entry) adds, from the 1-layer model run again at 8 rows, and at 8 rows with a vocabulary of 8192. `generate`
  works per row and its logits processors pass over every row's whole vocabulary each token (a GPT-2 at hidden
  192 spent 0.3 ms of a 3.8 ms token on a batch of 9 there, none of it in a forward's trace);

and times AdamW over many small tensors for `optimizer_tensor_s`, the optimizer's cost per parameter tensor
(taken out of the training terms, and composed back by each model's own tensor count). Converted over the
ranks (`tp=True`), the same split measures tpkit's parallel layers' Python and the wait for the slower rank.
Every run reads a buffer larger than a core's caches before each decoder layer, MLP and LM head, as a real model's
weights flush them (`CacheFlush`, below). None of it is fitted to any model it will later price: a model's step is
its kernels at the measured rates plus `step_s + layers * layer_s` of its family (`predict.price`).

Caches as a model's own modules leave them: a decoder layer's Python and dispatch cost what they cost when the CPU's
caches hold them, and between the modules of a real model they do not: each module first streams its weights
(megabytes) through those caches. On the 2-core box (4 MiB of L2 per core) one decoder layer's framework time in
`generate` at a batch of 8 was 0.26-0.32 ms on a tiny model that fits in the caches, and 0.74-0.75 ms with 8 MiB
read before each layer and its MLP, as a layer of a model at hidden 384 reads its weights; batched decoding of such
models came out 21-35% fast without it. So the calibration reads `FLUSH_BYTES` before each decoder layer, MLP and
LM head of its tiny models and leaves the time of those reads out of what it measures.
"""
from __future__ import annotations

import copy
import re
import statistics
import time
import warnings
from typing import Callable

import torch
from torch import nn

from ..nn.decode import adopt_decode_paths
from .calls import meta_copy
from .fake_step import trace_step
from .machine import FRAMEWORK_DTYPES, FRAMEWORK_LOGITS, FRAMEWORK_ROWS, FRAMEWORK_WIDTH, FrameworkCost, framework_key
from .ops import dtype_name
from .predict import dp_seconds, kernel_seconds, skew_factor
from .setup import Setup

__all__ = ["FAMILIES", "FLUSH_BYTES", "CacheFlush", "FrameworkCost", "flush_between_modules", "framework_costs",
           "generate_token_seconds", "optimizer_tensor_seconds", "tiny_config", "tiny_model", "train_step_seconds"]

FAMILIES = ("llama", "qwen2", "gpt2")
FRAMEWORK_GOALS = ("decode", "train")
LAYERS = (1, 3)
CONTEXT = 32
ROWS = 8  # the batch of the decode runs that measure what a row and a logit add
WIDE_VOCAB = 8192  # the vocabulary of the run that measures what a logit adds
FLUSH_BYTES = 8 << 20  # more than a server core's private caches (1-4 MiB), as one layer's weights of a real model
_MODULES = re.compile(r"(^|\.)(layers|h)\.\d+$|(^|\.)(mlp|lm_head)$")  # decoder layers, their MLPs, the LM head


class CacheFlush:
    """A forward pre-hook that reads `nbytes` (evicting what the caches held) and keeps the seconds it took in
    `spent`, so a timing can leave them out."""

    def __init__(self, nbytes: int = FLUSH_BYTES):
        self.buffer = torch.ones(max(1, nbytes // 4))
        self.spent = 0.0

    def __call__(self, module: nn.Module, args) -> None:
        start = time.perf_counter()
        self.buffer.sum()
        self.spent += time.perf_counter() - start


def flush_between_modules(model: nn.Module, flush: CacheFlush) -> list:
    """`flush` before each decoder layer, MLP and LM head of a transformers `model` (also inside DDP's `.module`);
    the hook handles."""
    return [m.register_forward_pre_hook(flush) for name, m in model.named_modules() if _MODULES.search(name)]


def tiny_config(family: str, layers: int, vocab: int = FRAMEWORK_LOGITS):
    """A config of `family` at hidden `FRAMEWORK_WIDTH` (64: 4 heads, MLP 128, vocabulary `vocab`) with `layers`
    layers."""
    import transformers as tr

    if family == "gpt2":
        return tr.GPT2Config(vocab_size=vocab, n_embd=FRAMEWORK_WIDTH, n_layer=layers, n_head=4, n_positions=128,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cls = tr.AutoConfig.for_model(family).__class__
    return cls(vocab_size=vocab, hidden_size=FRAMEWORK_WIDTH, intermediate_size=2 * FRAMEWORK_WIDTH,
               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
               tie_word_embeddings=False)


def tiny_model(family: str, layers: int, vocab: int = FRAMEWORK_LOGITS,
               dtype: torch.dtype = torch.float32) -> nn.Module:
    import transformers as tr

    torch.manual_seed(0)
    return tr.AutoModelForCausalLM.from_config(tiny_config(family, layers, vocab)).to(dtype)


def generate_token_seconds(model: nn.Module, context: int, repeats: int, comm=None, batch: int = 1,
                           pick=min, excluded: Callable[[], float] | None = None) -> float:
    """Seconds per generated token of greedy `generate` after a `context`-token prompt: the time of 9 new tokens
    less that of 1, over 8 (the prompt's prefill cancels); `pick` of `repeats` (default the least: what the
    framework costs, a busy machine only adds to it), every rank of `comm` in step; `excluded`: a clock of
    seconds to leave out (`CacheFlush.spent`)."""
    excluded = excluded or (lambda: 0.0)
    ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    model.eval()

    def run(n: int) -> float:
        if comm is not None:
            comm.barrier()
        start, left_out = time.perf_counter(), excluded()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start - (excluded() - left_out)
    run(2)
    return pick([(run(9) - run(1)) / 8 for _ in range(repeats)])


def train_step_seconds(model: nn.Module, seq: int, repeats: int, batch: int = 1, comm=None, pick=min,
                       excluded: Callable[[], float] | None = None) -> float:
    """`pick` (default the least) of `repeats` timed training steps (forward with the loss, backward, AdamW,
    zero_grad) on `model` itself, after two untimed ones; `excluded`: a clock of seconds to leave out."""
    excluded = excluded or (lambda: 0.0)
    model.train()
    vocab = getattr(model, "module", model).config.vocab_size  # DDP keeps the model as .module
    ids = torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for _ in range(repeats + 2):
        if comm is not None:
            comm.barrier()
        start, left_out = time.perf_counter(), excluded()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start - (excluded() - left_out))
    return pick(times[2:])


def optimizer_tensor_seconds(repeats: int = 7) -> float:
    """AdamW's seconds per parameter tensor: steps over 16 and over 128 small tensors, the difference per tensor
    (the fixed cost of a step cancels)."""
    def optimizer(count: int):
        params = [nn.Parameter(torch.zeros(16, 16)) for _ in range(count)]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(params, lr=1e-5)
        opt.step()
        return opt

    def seconds(opt) -> float:
        start = time.perf_counter()
        opt.step()
        return time.perf_counter() - start
    few, many = optimizer(16), optimizer(128)
    return max(min(seconds(many) - seconds(few) for _ in range(repeats)), 0.0) / 112


def _explained(model: nn.Module, plain: nn.Module, goal: str, rates, comm, tensor_s: float,
               dp_mode: str | None = None, layers: int = 1, batch: int = 1) -> float:
    """What `model`'s step takes that is not the framework's: its kernels and isolated collectives at `rates`
    (and, training, its optimizer tensors at `tensor_s`); `plain`: the unconverted model (traced for rank
    `comm.rank`, or whole under data parallelism, whose collectives are priced as the setup search prices them)."""
    world, rank = (comm.world_size, comm.rank) if comm is not None and dp_mode is None else (1, 0)
    trace = trace_step(meta_copy(plain), goal, world, rank, batch=batch, seq=CONTEXT)
    alone = sum(rates.collective(c.kind, c.world_size).seconds(c.nbytes) for c in trace.collectives)
    if dp_mode is not None:
        alone += dp_seconds(Setup(1, comm.world_size, dp_mode), goal, trace.parameter_bytes, layers, rates)
    tensors = sum(1 for p in model.parameters() if p.requires_grad) if goal == "train" else 0
    return kernel_seconds(trace, rates) * skew_factor(rates, goal, world > 1) + alone + tensors * tensor_s


def _measured(model: nn.Module, goal: str, comm, repeats: int, batch: int, flush: CacheFlush) -> float:
    """The median of `repeats` timings (the terms price the step a user sees, not the machine's best moment),
    the caches flushed between the modules as a real model's weights flush them (`CacheFlush`)."""
    if goal == "decode":
        return generate_token_seconds(model, CONTEXT, repeats, comm, batch=batch, pick=statistics.median,
                                      excluded=lambda: flush.spent)
    return train_step_seconds(model, CONTEXT, repeats, comm=comm, pick=statistics.median, excluded=lambda: flush.spent)


def _runs(goal: str, dp) -> tuple[tuple[int, int, int], ...]:
    """The (layers, batch rows, vocabulary) runs that measure `goal`'s terms (see the module doc)."""
    runs = tuple((layers, FRAMEWORK_ROWS, FRAMEWORK_LOGITS) for layers in LAYERS)
    if goal == "decode" and dp is None:
        runs += ((LAYERS[0], ROWS, FRAMEWORK_LOGITS), (LAYERS[0], ROWS, WIDE_VOCAB))
    return runs


def _terms(left: list[float]) -> FrameworkCost:
    """The terms from what each of `_runs`' runs left beyond its kernels and collectives."""
    layer_s = max((left[1] - left[0]) / (LAYERS[1] - LAYERS[0]), 0.0)
    step_s = max(left[0] - LAYERS[0] * layer_s, 0.0)
    if len(left) == 2:
        return FrameworkCost(step_s, layer_s)
    logit_s = max((left[3] - left[2]) / (ROWS * (WIDE_VOCAB - FRAMEWORK_LOGITS)), 0.0)
    row_s = max((left[2] - left[0] - (ROWS - FRAMEWORK_ROWS) * FRAMEWORK_LOGITS * logit_s) / (ROWS - FRAMEWORK_ROWS),
                0.0)
    return FrameworkCost(step_s, layer_s, row_s, logit_s)


def _variants(dp, dtypes) -> tuple[tuple[str, torch.dtype], ...]:
    """The (goal, dtype) pairs measured: training in float32 (under data parallelism: only it), decoding in each of
    `dtypes`."""
    if dp:
        return (("train", torch.float32),)
    return tuple((goal, d) for goal in FRAMEWORK_GOALS for d in (dtypes if goal == "decode" else (torch.float32,)))


def framework_costs(rates, comm=None, families=FAMILIES, repeats: int = 5, tensor_s: float = 0.0,
                    dp: tuple[str, Callable] | None = None,
                    dtypes: tuple[torch.dtype, ...] = FRAMEWORK_DTYPES) -> dict[str, FrameworkCost]:
    """`{"family/goal": FrameworkCost}` on this rank (see the module doc), decoding's also in each other of
    `dtypes` ("family/decode/bfloat16": `machine.framework_key`); with `comm` (call on every rank) the tiny
    models are converted over its ranks, else run whole (every rank at once when launched); with `dp` (mode,
    wrap: `wrap(model, comm)` puts a model under DDP or FSDP2 over `comm`), training only, under data parallelism
    instead, keyed "family/train/mode". The wrapper comes from the layer above (`tpkit.setups`): the estimate
    prices data parallelism and does not build it."""
    from ..convert.parallelize import parallelize

    out: dict[str, FrameworkCost] = {}
    for family in families:
        for goal, dtype in _variants(dp, dtypes):
            plains: dict[tuple[int, int], nn.Module] = {}  # one model per (layers, vocabulary), run at each batch
            built: dict[tuple[int, int], nn.Module] = {}
            runs, explained = _runs(goal, dp), []
            for layers, batch, vocab in runs:
                if (layers, vocab) not in built:
                    plain = plains[layers, vocab] = tiny_model(family, layers, vocab, dtype)
                    if dp is not None:
                        built[layers, vocab] = dp[1](copy.deepcopy(plain), comm)
                    elif comm is not None:
                        built[layers, vocab] = parallelize(copy.deepcopy(plain), "auto", comm,
                                                           mode="training" if goal == "train" else "inference")
                    else:  # whole, as one rank runs it (its Linear layers as a conversion leaves them)
                        built[layers, vocab] = copy.deepcopy(plain)
                        adopt_decode_paths(built[layers, vocab])
                explained.append(_explained(built[layers, vocab], plains[layers, vocab], goal, rates, comm, tensor_s,
                                            dp[0] if dp else None, layers, batch))
            flush = CacheFlush()  # after the traces: a fake tensor run must not meet the hook
            for model in built.values():
                flush_between_modules(model, flush)
            times: list[list[float]] = [[] for _ in runs]
            for _ in range(max(2, repeats // 2)):  # alternating, so a slow spell weighs on every run alike
                for i, (layers, batch, vocab) in enumerate(runs):
                    times[i].append(_measured(built[layers, vocab], goal, comm, 3, batch, flush))
            key = f"{family}/{goal}/{dp[0]}" if dp else framework_key(family, goal, dtype_name(dtype))
            out[key] = _terms([statistics.median(t) - e for t, e in zip(times, explained)])
    return out
