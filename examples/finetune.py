"""Fine-tune a Hugging Face causal LM with tensor parallelism (and data and pipeline parallelism).

4 ranks as tp2 x dp2, on the text of train.txt; a checkpoint every 20 steps, a Hugging Face directory at the end:

    torchrun --nproc-per-node 4 examples/finetune.py --model ./my-llama --tp 2 --data train.txt \\
             --steps 100 --save run/ckpt --every 20 --consolidate run/my-llama-tuned

The same 4 ranks as tp2 x cp2: each sequence split over 2 ranks (context parallelism, for long sequences):

    torchrun --nproc-per-node 4 examples/finetune.py --model ./my-llama --tp 2 --cp 2 --seq 8192 --data train.txt \\
             --steps 100 --save run/ckpt --consolidate run/my-llama-tuned

The same 4 ranks as 2 pipeline stages of tp2 each, 4 micro-batches per step under 1F1B:

    torchrun --nproc-per-node 4 examples/finetune.py --model ./my-llama --pp 2 --tp 2 --schedule 1f1b \\
             --microbatches 4 --data train.txt --steps 100 --save run/ckpt --consolidate run/my-llama-tuned

Stopped (or a rank died)? The same command with --resume continues from the newest complete checkpoint, and
under `torchrun --max-restarts 3` that happens by itself. The result loads like any checkpoint:
`transformers.AutoModelForCausalLM.from_pretrained("run/my-llama-tuned")`, or at TP with examples/generate.py.

Each rank reads only its slices of the checkpoint (`tpkit.from_pretrained(..., mode="training")`: the LM head
keeps its logits split over the vocabulary and the model's loss is computed on them, never gathered). With
world > tp, the tp groups are data-parallel replicas (FSDP2 or DDP over the dp groups). With `--pp P` the layers are
cut into P stages (`tpkit.pipeline`: world = pp x dp x tp, tp innermost; each rank reads only its stage's tensors),
each step runs `--microbatches` micro-batches through torch's `--schedule`, and the loss is the mean of the
micro-batches' losses (equal to the batch's: every window has `--seq` tokens). With `--cp C` each sequence is split
over C ranks (`tpkit.context_parallel`: world = pp x dp x cp x tp; every cp rank is given the whole sequences and
keeps its own tokens; the loss is the token mean of the whole sequences, the gradients summed over cp; FSDP2
shards the weights over dp x cp, DDP averages over dp). The
checkpoints are the ordinary ones: a run saved at one pp x dp x cp x tp resumes at another. `--data FILE` is text
tokenized with the model directory's tokenizer when it has one, else whitespace-separated integer token ids;
without it, random tokens (the mechanics, not a recipe). The batch of step s is `--global-batch` windows of
`--seq` tokens at offsets drawn from a generator seeded by s alone: a resumed run sees the batches an
uninterrupted one would. Each rank runs one intra-op CPU thread when several share the host
(`tpkit.launch.set_threads`; `TPKIT_THREADS=N` or `OMP_NUM_THREADS=N` to change it).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import transformers as tr

import tpkit
from tpkit import faults
from tpkit.checkpoint.tokenizer import tokenizer_files
from tpkit.launch import set_threads
from tpkit.pipeline import SCHEDULES


def tokenizer_in(directory: str):
    """The directory's tokenizer, or None when it has none (the files `tpkit consolidate` copies)."""
    if not tokenizer_files(directory):
        return None
    return tr.AutoTokenizer.from_pretrained(directory)


def load_tokens(path: str, tokenizer, vocab: int) -> torch.Tensor:
    """The whole file as one stream of token ids: text through `tokenizer`, or integers when it is None."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if tokenizer is not None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        try:
            ids = [int(t) for t in text.split()]
        except ValueError as exc:
            raise SystemExit(f"{path}: the model directory has no tokenizer, so --data must hold whitespace-separated "
                             f"integer token ids ({exc})") from None
    tokens = torch.tensor(ids, dtype=torch.long)
    if len(tokens) and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab:
        raise SystemExit(f"{path}: token ids must be in 0..{vocab - 1} (the model's vocabulary)")
    return tokens


def batch(step: int, tokens: torch.Tensor | None, vocab: int, args) -> torch.Tensor:
    """The global batch of `step` (the same on every rank, and after a restart)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    if tokens is None:
        return torch.randint(0, vocab, (args.global_batch, args.seq), generator=g)
    starts = torch.randint(0, len(tokens) - args.seq + 1, (args.global_batch,), generator=g)
    return torch.stack([tokens[s:s + args.seq] for s in starts.tolist()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the world size); "
                                                             "dp = world / tp")
    parser.add_argument("--dp-mode", choices=("fsdp", "ddp"), default="fsdp", help="engine of the dp dimension")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (ranks); dp = world / (pp x cp x tp)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size: each sequence split over this many "
                                                           "ranks")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size: a MoE model's experts spread over "
                                                           "this many ranks of dp x cp x tp (a multiple of tp)")
    parser.add_argument("--cp-method", choices=("auto", "all_to_all", "ring"), default="auto",
                        help="how attention crosses the sequence split (auto: all-to-all where the heads allow)")
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b",
                        help="torch's pipeline schedule (with --pp)")
    parser.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default: pp x "
                                                                      "stages per rank)")
    parser.add_argument("--stages-per-rank", type=int, default=None, help="stages per rank for the interleaved and "
                                                                          "zero-bubble schedules (default 2)")
    parser.add_argument("--data", default=None, help="training text, tokenized with --model's tokenizer; without "
                                                     "one, whitespace-separated integer token ids (default: random)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step over all dp ranks")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--max-norm", type=float, default=1.0, help="clip the global gradient norm to this")
    parser.add_argument("--dtype", default="float32", help="weights' dtype in training ('auto': the checkpoint's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batches")
    parser.add_argument("--save", default=None, help="checkpoint directory (after the last step, every --every)")
    parser.add_argument("--every", type=int, default=0, help="save every N steps (0: after the last only)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --save")
    parser.add_argument("--check-replicas", type=int, default=50, metavar="N",
                        help="check every N steps that tensors several ranks hold are identical (0: off)")
    parser.add_argument("--consolidate", default=None, metavar="OUT",
                        help="at the end, write the final checkpoint as a Hugging Face directory (needs --save)")
    args = parser.parse_args()
    if (args.resume or args.consolidate) and not args.save:
        raise SystemExit("--resume and --consolidate need --save DIR (the checkpoints they read)")
    if args.consolidate and os.path.isdir(args.consolidate) and os.listdir(args.consolidate):
        raise SystemExit(f"--consolidate {args.consolidate}: not empty; choose a new directory")

    set_threads()
    comm = tpkit.init()
    tokenizer = tokenizer_in(args.model)
    pipe = None
    if args.pp > 1:  # each rank builds, reads and converts only its stages; dp groups under FSDP2 or DDP
        pipe = tpkit.pipeline(args.model, comm, pp=args.pp, tp=args.tp or comm.world_size // (args.pp * args.cp),
                              cp=args.cp, cp_method=args.cp_method, ep=args.ep, schedule=args.schedule,
                              microbatches=args.microbatches,
                              stages_per_rank=args.stages_per_rank, dp_mode=args.dp_mode, dtype=args.dtype)
        model, tp, dp = pipe.model.train(), pipe.groups.tp, pipe.groups.dp
    else:
        try:
            groups = tpkit.comm.groups(comm, tp=args.tp or comm.world_size // args.cp, cp=args.cp, ep=args.ep)
        except ValueError as exc:
            raise SystemExit(f"--ep {args.ep}: {exc}") from None
        tp, dp = groups.tp, groups.dp
        def spread_experts(meta_model):  # each rank reads and keeps its experts; tokens travel to them by all-to-all
            tpkit.parallelize(meta_model, tpkit.KEEP_EXPERTS_WHOLE, comm=tp, mode="training")
            tpkit.expert_parallel(meta_model, groups)

        model = tpkit.from_pretrained(args.model, comm=tp, mode="training", dtype=args.dtype,
                                      convert=spread_experts if args.ep > 1 else None).train()
        if args.cp > 1:  # whole sequences in, each cp rank keeps its zigzag share of every sequence
            tpkit.context_parallel(model, groups.cp, method=args.cp_method)
    if args.global_batch % dp.world_size or pipe is not None and args.global_batch // dp.world_size % pipe.microbatches:
        raise SystemExit(f"--global-batch {args.global_batch} must divide by the dp size {dp.world_size}"
                         + (f" times the micro-batches {pipe.microbatches}" if pipe is not None else ""))
    vocab, device, rank = model.config.vocab_size, next(model.parameters()).device, comm.rank
    tokens = load_tokens(args.data, tokenizer, vocab) if args.data else None
    if tokens is not None and len(tokens) < args.seq:
        raise SystemExit(f"--data {args.data}: {len(tokens)} tokens, fewer than --seq {args.seq}")
    # FSDP2 shards over every rank holding the same weights (dp x cp, as Megatron and torchtitan do); DDP over dp
    engine = groups.dp_cp if pipe is None and args.dp_mode == "fsdp" else dp
    if engine.world_size > 1 and pipe is None:
        model = tpkit.data_parallel(model, engine, mode=args.dp_mode)
    tpkit.data_parallel_manual_seed(1234, tp, dp)  # dropout: the same where tp ranks hold the same activations
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ckpt = tpkit.Checkpointer(args.save, every=args.every or max(args.steps, 1), comm=comm,
                              check_replicas_every=None) if args.save else None
    if args.check_replicas:  # a silent divergence of replicas raises tpkit.ReplicaError from opt.step()
        tpkit.watch_replicas(model, opt, every=args.check_replicas)
    start = ckpt.resume(model, opt) if args.resume else 0
    if comm.rank == 0:
        cp, ep = f" x cp{args.cp}" if args.cp > 1 else "", f", ep{args.ep}" if args.ep > 1 else ""
        layout = f"pp{args.pp} x dp{dp.world_size}{cp} x tp{tp.world_size}{ep} ({args.schedule}, {pipe.microbatches} " \
                 f"micro-batches)" if pipe is not None else f"tp{tp.world_size} x dp{dp.world_size}{cp}{ep}"
        print(f"{args.model}: world {comm.world_size} = {layout}, {torch.get_num_threads()} thread(s) per rank, "
              f"starting at step {start}", flush=True)

    for step in range(start, args.steps):
        faults.at("step", rank, step)  # TPKIT_FAULTS: the restart tests kill a rank here
        begin = time.perf_counter()
        mine = batch(step, tokens, vocab, args).chunk(dp.world_size)[dp.rank].to(device)
        if pipe is not None:  # forward and backward of every micro-batch; the mean loss, on every rank
            loss = pipe.step(mine, mine)
        else:
            loss = model(input_ids=mine, labels=mine).loss  # labels are shifted inside, as in transformers
            loss.backward()
        norm = tpkit.clip_grad_norm_(model.parameters(), args.max_norm)  # the norm of the whole model
        opt.step()
        opt.zero_grad()
        loss = dp.all_reduce(loss.detach()) / dp.world_size
        if comm.rank == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}  grad norm {norm.item():.4f}  "
                  f"{(time.perf_counter() - begin) * 1e3:.0f} ms", flush=True)
        if ckpt is not None:
            ckpt.maybe_save(step + 1, model, opt)
    if ckpt is not None and start < args.steps and args.steps % ckpt.every:  # the last step, unless just saved
        ckpt.save(args.steps, model, opt)
    comm.barrier()  # every rank's part of the last checkpoint is written
    tpkit.shutdown()
    if args.consolidate and rank == 0:  # one process reads the pieces back: no collective, no timeout
        # the model directory's tokenizer files beside the weights, as `tpkit consolidate` copies them
        tpkit.consolidate(args.save, args.consolidate, tokenizer=args.model if tokenizer is not None else None)
        print(f"wrote {args.consolidate} (a Hugging Face directory)", flush=True)


if __name__ == "__main__":
    main()
