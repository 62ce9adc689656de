"""Fine-tune a Hugging Face causal LM with transformers' Trainer, tensor-parallel: the import is the one change.

4 ranks as tp2 x dp2, on the text of train.txt; a checkpoint every 20 steps, a Hugging Face directory at the end:

    torchrun --nproc-per-node 4 examples/trainer.py --model ./my-llama --tp 2 --data train.txt --steps 100 \\
             --save-steps 20 --out run

The same 4 ranks as tp2 x cp2, each sequence split over 2 ranks (context parallelism, for long sequences):

    torchrun --nproc-per-node 4 examples/trainer.py --model ./my-llama --tp 2 --cp 2 --seq 8192 --data train.txt \\
             --steps 100 --out run

`--resume` continues from the newest `run/checkpoint-N` (at any tp / cp / dp size with the same global batch). The
result loads like any model: `transformers.AutoModelForCausalLM.from_pretrained("run")`.

What differs from a one-process Trainer script: `tpkit.init()`, the ranks laid out by `tpkit.comm.groups` (world =
dp x cp x tp, tp innermost), the model converted on the tensor-parallel group (`tpkit.from_pretrained(...,
comm=g.tp, mode="training")`) and, with `--cp C`, made context-parallel over the cp group (`tpkit.context_parallel`:
every cp rank is given the whole rows and keeps its share of each sequence's tokens), and `tpkit.trainer.Trainer` in
place of `transformers.Trainer`. `--batch` is per data-parallel replica (the tp x cp ranks of one replica read the
same rows): the global batch is batch x dp. The data: `--data FILE` is text tokenized with the model directory's
tokenizer when it has one, else whitespace-separated integer token ids, cut into windows of `--seq` tokens (the last
`--eval` windows are the evaluation set); without it, random tokens.
"""
from __future__ import annotations

import argparse
import os

import torch
import transformers as tr

import tpkit
import tpkit.trainer
from tpkit.launch import set_threads


class Windows(torch.utils.data.Dataset):
    """Rows of `seq` tokens (labels = inputs: the model shifts them)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def datasets(args, vocab: int) -> tuple[Windows, Windows]:
    """(training, evaluation) windows of the data file (or of random tokens), the same on every rank."""
    if args.data:
        with open(args.data, encoding="utf-8") as f:
            text = f.read()
        has_tokenizer = os.path.exists(os.path.join(args.model, "tokenizer_config.json"))
        ids = tr.AutoTokenizer.from_pretrained(args.model)(text, add_special_tokens=False)["input_ids"] \
            if has_tokenizer else [int(t) for t in text.split()]
        tokens = torch.tensor(ids, dtype=torch.long)
    else:
        tokens = torch.randint(0, vocab, (args.seq * 64,), generator=torch.Generator().manual_seed(args.seed))
    rows = tokens[:len(tokens) // args.seq * args.seq].view(-1, args.seq)
    if len(rows) <= args.eval:
        raise SystemExit(f"--data: {len(rows)} windows of {args.seq} tokens; need more than --eval {args.eval}")
    return Windows(rows[:-args.eval] if args.eval else rows), Windows(rows[-args.eval:] if args.eval else rows[:0])


def training_arguments(args, **changes) -> tr.TrainingArguments:
    """What the run asks of Trainer (the same for tpkit's Trainer and a one-process one)."""
    evaluate = args.eval > 0
    return tr.TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, learning_rate=args.lr, max_grad_norm=args.max_norm,
        logging_steps=args.log_every, save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, eval_strategy="steps" if evaluate else "no",
        eval_steps=args.save_steps or args.steps, report_to=[], seed=args.seed, use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True, fsdp="full_shard" if args.fsdp else "", **changes)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the world / cp); "
                   "dp = world / (tp x cp)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size: each sequence split over this many ranks")
    p.add_argument("--cp-method", choices=("auto", "all_to_all", "ring"), default="auto",
                   help="context-parallel attention (tpkit.context_parallel's method)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 over the data-parallel ranks (default: DDP)")
    p.add_argument("--data", default=None, help="training text (default: random tokens)")
    p.add_argument("--seq", type=int, default=128, help="tokens per window")
    p.add_argument("--eval", type=int, default=8, help="windows kept for evaluation (0: none)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=4, help="rows per step per data-parallel replica")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-norm", type=float, default=1.0, help="clip the global gradient norm to this")
    p.add_argument("--dtype", default="float32", help="weights' dtype in training ('auto': the checkpoint's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--save-steps", type=int, default=0, help="a checkpoint-N (and an evaluation) every N steps")
    p.add_argument("--out", required=True, help="the run's directory: checkpoint-N folders, the final model")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint-N in --out")
    return p


def main() -> None:
    args = parser().parse_args()
    set_threads()
    comm = tpkit.init()
    g = tpkit.comm.groups(comm, tp=args.tp or comm.world_size // args.cp, cp=args.cp)  # cp 1: tpkit.comm.split's
    model = tpkit.from_pretrained(args.model, comm=g.tp, mode="training", dtype=args.dtype)
    if args.cp > 1:  # whole rows in, each cp rank keeps its zigzag share of every sequence
        tpkit.context_parallel(model, g.cp, method=args.cp_method)
    train, evaluation = datasets(args, model.config.vocab_size)
    tokenizer = tr.AutoTokenizer.from_pretrained(args.model) \
        if os.path.exists(os.path.join(args.model, "tokenizer_config.json")) else None
    trainer = tpkit.trainer.Trainer(model=model, args=training_arguments(args), train_dataset=train,
                                    eval_dataset=evaluation if args.eval else None, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model()  # every rank: one Hugging Face directory in --out, beside the checkpoints
    if comm.rank == 0:
        print(f"wrote {args.out} (a Hugging Face directory; tp{g.tp.world_size} x cp{g.cp.world_size} x "
              f"dp{g.dp.world_size})", flush=True)


if __name__ == "__main__":
    main()
