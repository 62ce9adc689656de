"""What the tpkit.trainer tests share: a tiny float64 Llama saved with a word-level tokenizer, the data, the training
arguments, and the one-process references (stock transformers / TRL / PEFT, no torch.distributed).

Float64 models keep the figures tight (Llama's norms still round through float32; Trainer's running loss is a
float32 sum): logged loss and grad norm to ~1e-7, weights after AdamW to ~1e-6. Clipping is active (max_grad_norm
below the first steps' norms)."""
from __future__ import annotations

import os

import torch

VOCAB = 97  # odd: the vocabulary splits unevenly at 2 ranks (49 + 48) and 3 (33 + 32 + 32)
SEQ = 12
STEPS = 6


def make_model(directory: str, layers: int = 2, vocab: int = VOCAB) -> str:
    """A tiny Llama (8 heads, 4 KV heads) and a word-level tokenizer "w0" .. "w93" in `directory`."""
    import transformers as tr

    config = tr.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)
    torch.manual_seed(0)
    tr.LlamaForCausalLM(config).save_pretrained(directory)
    return save_tokenizer(directory)


def save_tokenizer(directory: str) -> str:
    """The word-level tokenizer "w0" .. "w93" (ids 3 .. 96; pad, bos, eos 0, 1, 2) in `directory`."""
    import transformers as tr
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tr.PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<s>", eos_token="</s>",
                               pad_token="<pad>").save_pretrained(directory)
    return directory


class Rows(torch.utils.data.Dataset):
    """`n` rows of `SEQ` token ids (labels = inputs), drawn from `seed`."""

    def __init__(self, n: int, seed: int):
        self.ids = torch.randint(3, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train_rows() -> Rows:
    return Rows(48, 1)


def eval_rows() -> Rows:
    return Rows(10, 2)  # 10 rows in batches of 3: the last batch is short


def arguments(output_dir: str, **changes):
    """The training arguments every run shares (Trainer's own defaults otherwise)."""
    import transformers as tr

    base = dict(output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=4, per_device_eval_batch_size=3,
                learning_rate=1e-3, max_grad_norm=0.5, logging_steps=1, eval_strategy="steps", eval_steps=3,
                save_strategy="no", report_to=[], seed=0, disable_tqdm=True, use_cpu=True,
                include_num_input_tokens_seen="all")
    base.update(changes)
    return tr.TrainingArguments(**base)


def next_token_accuracy(prediction) -> dict:
    """`compute_metrics`: the share of next tokens whose label is the argmax of the full logits, and the perplexity
    from the full softmax (both silently wrong on a vocabulary slice)."""
    logits = torch.as_tensor(prediction.predictions)[:, :-1]
    labels = torch.as_tensor(prediction.label_ids)[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return {"accuracy": (logits.argmax(-1) == labels).double().mean().item(), "perplexity": nll.exp().item()}


def logged(history: list[dict], keys=("loss", "grad_norm", "eval_loss", "eval_accuracy", "eval_perplexity",
                                      "mean_token_accuracy", "entropy")) -> list[tuple]:
    """`(step, key, value)` of the figures a log history holds, in order."""
    return [(h["step"], k, h[k]) for h in history for k in keys if k in h]


def state_of(directory: str) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face directory, as plain transformers loads them (float64)."""
    import transformers as tr

    return tr.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float64).state_dict()


def rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def same_figures(got: list[tuple], want: list[tuple], tolerance: float) -> list[str]:
    """The differences between two `logged` lists beyond `tolerance` (relative), as readable lines."""
    if [(s, k) for s, k, _ in got] != [(s, k) for s, k, _ in want]:
        return [f"different figures: {[(s, k) for s, k, _ in got]} vs {[(s, k) for s, k, _ in want]}"]
    return [f"step {s} {k}: {a} vs {b}" for (s, k, a), (_, _, b) in zip(got, want)
            if abs(a - b) > tolerance * max(abs(b), 1e-12)]


def one_process_trainer(directory: str, output_dir: str, **changes):
    """Plain transformers.Trainer on the unconverted model, this process alone (the reference)."""
    import transformers as tr

    model = tr.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float64)
    trainer = tr.Trainer(model=model, args=arguments(output_dir, **changes), train_dataset=train_rows(),
                         eval_dataset=eval_rows(), compute_metrics=next_token_accuracy)
    trainer.train()
    trainer.save_model(os.path.join(output_dir, "final"))
    return trainer
