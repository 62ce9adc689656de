"""Supervised fine-tuning with TRL's SFTTrainer on a tensor-parallel model (`pip install "tpkit[trl]"`).

2 ranks as tp2, on the lines of train.txt (one example per line), the model's tokenizer, TRL's defaults otherwise:

    torchrun --nproc-per-node 2 examples/sft.py --model ./my-llama --data train.txt --steps 50 --out run-sft

TRL's loss and its `mean_token_accuracy` and `entropy` metrics are computed over the whole vocabulary from each
rank's slice of it (a few all-reduces of per-token statistics; the full logits are never gathered). The result is
a Hugging Face directory (`--out`). `--packing` packs the examples into `--seq`-token rows, as TRL does.
"""
from __future__ import annotations

import argparse

import torch

import tpkit
import tpkit.trainer
from tpkit.launch import set_threads


def config(args, **changes):
    """The SFTConfig of the run (the same for tpkit's SFTTrainer and a one-process TRL one)."""
    from trl import SFTConfig

    cpu = not torch.cuda.is_available()
    return SFTConfig(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch,
                     learning_rate=args.lr, max_grad_norm=args.max_norm, logging_steps=args.log_every,
                     max_length=args.seq, packing=args.packing, report_to=[], seed=args.seed, use_cpu=cpu,
                     bf16=args.bf16, gradient_checkpointing=args.gradient_checkpointing, save_strategy="no",
                     disable_tqdm=True, dataset_num_proc=None, **changes)


def dataset(path: str):
    import datasets

    with open(path, encoding="utf-8") as f:
        return datasets.Dataset.from_dict({"text": [line.strip() for line in f if line.strip()]})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory with its tokenizer")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the world); dp = world / tp")
    p.add_argument("--data", required=True, help="text, one example per line")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=4, help="rows per step per data-parallel replica")
    p.add_argument("--seq", type=int, default=128, help="max_length (and the packed row length)")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--packing", action="store_true")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False, help="bf16 autocast (TRL's "
                                                                                         "default on GPUs)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", required=True)
    return p


def main() -> None:
    import transformers as tr

    args = parser().parse_args()
    set_threads()
    comm = tpkit.init()
    tp, _ = tpkit.comm.split(comm, args.tp or comm.world_size)
    model = tpkit.from_pretrained(args.model, comm=tp, mode="training", dtype=args.dtype)
    trainer = tpkit.trainer.SFTTrainer(model=model, args=config(args), train_dataset=dataset(args.data),
                                       processing_class=tr.AutoTokenizer.from_pretrained(args.model))
    trainer.train()
    trainer.save_model()
    if comm.rank == 0:
        print(f"wrote {args.out} (a Hugging Face directory)", flush=True)


if __name__ == "__main__":
    main()
