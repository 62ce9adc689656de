"""Tensor parallelism with tpkit inside a PyTorch Lightning Trainer, checked against a plain training loop.

    pip install 'tpkit[lightning]'
    python examples/lightning_tp.py --steps 6            # 2 CPU processes over gloo; a GPU machine: --accelerator gpu

Lightning starts the processes and torch.distributed (its `ModelParallelStrategy`, tensor parallel size 2,
no data parallelism) and calls `configure_model` on every rank, where tpkit converts the full model into this
rank's shards over the strategy's tensor-parallel group. From then on Lightning trains it as any module:
`training_step`, the optimizer over the converted parameters, gradient clipping through
`tpkit.clip_grad_norm_` (the norm over every shard, which torch's own clipping would compute per rank). Every
rank must see the same batches, as tensor parallelism needs: `use_distributed_sampler=False` keeps the
loader as given (Lightning would otherwise put in a sampler that shuffles the training data).

Afterwards rank 0 trains the same model, from the same seed and on the same batches, in a plain
single-process loop, and compares the losses step by step (`--out FILE` writes both as JSON). They agree to
float32 rounding: the shards sum their partial products in another order, and AdamW (which divides by the
root of tiny second moments) lets those differences grow a little each step, so the check is relative 1e-4
over the steps (1e-6 at the first, before any update). Exit status 1 if they do not agree.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import transformers as tr

import tpkit

try:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
except ImportError as exc:  # pragma: no cover - the message is the point
    raise SystemExit("this example needs Lightning: pip install 'tpkit[lightning]' (or pip install lightning)") from exc

TP = 2


def build_model(vocab: int) -> torch.nn.Module:
    config = tr.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64)
    torch.manual_seed(0)  # the same full model on every rank (and in the plain loop); each rank keeps its shards
    return tr.LlamaForCausalLM(config)


def batches(steps: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (steps * batch, seq), generator=torch.Generator().manual_seed(1))


class TPLlama(L.LightningModule):
    def __init__(self, vocab: int, lr: float, max_norm: float):
        super().__init__()
        self.model = build_model(vocab)
        self.lr, self.max_norm = lr, max_norm
        self.losses: list[float] = []
        self.comm = None

    def configure_model(self) -> None:
        if self.comm is not None:  # Lightning may call the hook again (fit, then validate): convert once
            return
        group = self.device_mesh["tensor_parallel"].get_group()
        self.comm = tpkit.comm.create_communicator("torch", group=group)
        tpkit.parallelize(self.model, comm=self.comm, mode="training")

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        tpkit.clip_grad_norm_(self.parameters(), self.max_norm)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def on_train_end(self) -> None:
        # every rank's losses to every rank, while the group is up: the ranks must agree with each other too
        mine = torch.tensor(self.losses, dtype=torch.float64)
        self.all_rank_losses = self.comm.all_gather(mine.unsqueeze(0)).tolist()
        self.q_proj_shape = list(self.model.model.layers[0].self_attn.q_proj.weight.shape)  # this rank's shard


def plain_losses(steps: int, batch: int, seq: int, vocab: int, lr: float, max_norm: float) -> list[float]:
    """The same training, one process, no tpkit, no Lightning."""
    model = build_model(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for ids in batches(steps, batch, seq, vocab).split(batch):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--out", help="write the losses (Lightning per rank, plain loop) here as JSON")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # two processes on a small machine
    data = torch.utils.data.TensorDataset(batches(args.steps, args.batch, args.seq, args.vocab))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=False)
    module = TPLlama(args.vocab, args.lr, args.max_norm)
    trainer = L.Trainer(accelerator=args.accelerator, devices=TP,
                        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=TP),
                        max_steps=args.steps, gradient_clip_val=args.max_norm, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    if trainer.global_rank != 0:
        return 0
    lightning = module.all_rank_losses
    plain = plain_losses(args.steps, args.batch, args.seq, args.vocab, args.lr, args.max_norm)
    for step, (ours, ref) in enumerate(zip(lightning[0], plain)):
        print(f"step {step}: Lightning + tpkit (tp {TP}) {ours:.6f}   plain loop {ref:.6f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"lightning": lightning, "plain": plain, "q_proj_local_shape": module.q_proj_shape}, f)
    ranks_agree = all(row == lightning[0] for row in lightning)
    ours, ref = torch.tensor(lightning[0], dtype=torch.float64), torch.tensor(plain, dtype=torch.float64)
    close = len(ours) == len(ref) and bool(((ours - ref).abs() <= 1e-4 * ref.abs()).all()) \
        and abs(ours[0] - ref[0]) <= 1e-6 * abs(ref[0])
    print("losses equal the plain loop" if ranks_agree and close else "LOSSES DIFFER")
    return 0 if ranks_agree and close else 1


if __name__ == "__main__":
    sys.exit(main())
