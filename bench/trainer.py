"""Step time of `tpkit.trainer.Trainer` at TP2 against tpkit's own fine-tune loop at the same shape (the integration's
overhead: Trainer, accelerate and tpkit's accelerator around the same forward, backward, clip and AdamW step), and
against one process of plain `transformers.Trainer` on the same global batch.

On 2 gloo ranks (one intra-op thread each), each rank loads the same Llama checkpoint (`from_pretrained`,
mode="training", float32). Each round runs a Trainer block of `--steps` steps (`logging_steps=10`, a callback
timing each optimizer step) and a loop block of as many steps (examples/finetune.py's step: forward with labels,
backward, `tpkit.clip_grad_norm_`, AdamW, the loss read back every step as the example prints it), which one first
alternating between rounds. The first 3 steps
of each block are dropped; the figure is the median of the rest over all rounds. The plain Trainer runs after, in
this process (two intra-op threads: the box's two cores), on the same rows.

The shape is drawn from `--seed` (not tuned: it changes with the seed), sized so that a step takes over 100 ms.

    PYTHONPATH=src python bench/trainer.py [--rounds 3] [--steps 23] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import tpkit

SEQ_CHOICES, HIDDEN_CHOICES, LAYER_CHOICES = (192, 256), (384, 448, 512), (3, 4)


def shape(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    return {"hidden": pick(HIDDEN_CHOICES), "layers": pick(LAYER_CHOICES), "seq": pick(SEQ_CHOICES), "batch": 4,
            "vocab": 8000}


def make(directory: str, s: dict) -> None:
    import transformers as tr

    config = tr.LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["hidden"] * 8 // 3,
                            num_hidden_layers=s["layers"], num_attention_heads=8, num_key_value_heads=4,
                            max_position_embeddings=s["seq"])
    torch.manual_seed(0)
    tr.LlamaForCausalLM(config).save_pretrained(directory)


class Rows(torch.utils.data.Dataset):
    def __init__(self, s: dict, n: int):
        self.ids = torch.randint(0, s["vocab"], (n, s["seq"]), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out: str, steps: int, batch: int):
    import transformers as tr

    return tr.TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch,
                                learning_rate=1e-5, max_grad_norm=1.0, logging_steps=10, save_strategy="no",
                                report_to=[], disable_tqdm=True, use_cpu=True, seed=0)


def _timer():
    import transformers as tr

    class StepTimes(tr.TrainerCallback):
        def __init__(self):
            self.times, self.last = [], None

        def on_step_begin(self, args, state, control, **kw):
            self.last = self.last or time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now

    return StepTimes()


def _trainer_block(directory: str, s: dict, steps: int, out: str) -> list[float]:
    import tpkit.trainer

    model = tpkit.from_pretrained(directory, mode="training", dtype=torch.float32)
    timer = _timer()
    trainer = tpkit.trainer.Trainer(model=model, args=_args(out, steps, s["batch"]),
                                    train_dataset=Rows(s, steps * s["batch"]), callbacks=[timer])
    trainer.train()
    return timer.times[3:]


def _loop_block(directory: str, s: dict, steps: int) -> list[float]:
    model = tpkit.from_pretrained(directory, mode="training", dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rows, times = Rows(s, steps * s["batch"]).ids, []
    for step in range(steps):
        begin = time.perf_counter()
        ids = rows[step * s["batch"]:(step + 1) * s["batch"]]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = tpkit.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        loss.item(), norm.item()  # the example prints both every step
        times.append(time.perf_counter() - begin)
    return times[3:]


def _ranks(directory: str, s: dict, rounds: int, steps: int, out: str) -> dict:
    tpkit.init()
    torch.set_num_threads(1)
    got = {"trainer": [], "loop": []}
    blocks = [("trainer", lambda: _trainer_block(directory, s, steps, out)), ("loop", lambda: _loop_block(directory, s,
                                                                                                        steps))]
    for r in range(rounds):
        for name, block in blocks[::1 if r % 2 == 0 else -1]:  # which goes first alternates
            got[name] += block()
    return got


def _one_process(directory: str, s: dict, steps: int, out: str) -> list[float]:
    import transformers as tr

    torch.set_num_threads(2)
    model = tr.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    timer = _timer()
    tr.Trainer(model=model, args=_args(out, steps, s["batch"]), train_dataset=Rows(s, steps * s["batch"]),
               callbacks=[timer]).train()
    return timer.times[3:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=23)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    s = shape(args.seed)
    with tempfile.TemporaryDirectory() as root:
        directory = os.path.join(root, "model")
        make(directory, s)
        ranks = tpkit.launch(_ranks, 2, args=(directory, s, args.rounds, args.steps, os.path.join(root, "out")),
                             timeout=3600)
        one = _one_process(directory, s, args.steps * args.rounds, os.path.join(root, "one"))
    trainer, loop = (statistics.median(ranks[0][k]) for k in ("trainer", "loop"))
    plain = statistics.median(one)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, load {os.getloadavg()[0]:.1f}; Llama hidden {s['hidden']}, "
          f"{s['layers']} layers, vocab {s['vocab']}, batch {s['batch']} x {s['seq']} tokens, float32; "
          f"{len(ranks[0]['trainer'])} timed steps each (median)")
    print("| run | ms / step | ratio to the loop |\n|---|---|---|")
    print(f"| tpkit's fine-tune loop, tp2 (2 processes x 1 thread) | {loop * 1e3:.0f} | 1.000 |")
    print(f"| tpkit.trainer.Trainer, tp2 (2 processes x 1 thread) | {trainer * 1e3:.0f} | {trainer / loop:.3f} |")
    print(f"| transformers.Trainer, one process (2 threads) | {plain * 1e3:.0f} | {plain / loop:.3f} |")


if __name__ == "__main__":
    main()
