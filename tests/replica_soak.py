"""Clean training that the replica sentinel must never flag (bench/replicas.py soak, tests/test_replicas.py): tiny
models at TP 2 and 3 on gloo processes, every step checked, with dropout, full recompute, two micro-batches of
gradient accumulation, bf16 autocast and global-norm clipping. Module level so spawned ranks import it."""
from __future__ import annotations

import torch


def llama(hidden: int, layers: int, heads: int, kv: int, dropout: float = 0.0):
    import transformers as tr

    cfg = tr.LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=hidden * 4 // 3 * 2,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                         max_position_embeddings=256, attention_dropout=dropout)
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(cfg)


def gpt2(dropout: float):
    import transformers as tr

    torch.manual_seed(0)
    return tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=1000, n_embd=96, n_layer=2, n_head=6, n_positions=256,
                                            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout))


def soak_body(arch: str, steps: int) -> int:
    import tpkit
    from tpkit.nn import vocab_parallel_cross_entropy

    torch.set_num_threads(1)
    comm = tpkit.get_communicator()
    tpkit.nn.model_parallel_manual_seed(1234, comm)
    base = llama(64, 2, 8, 2, dropout=0.1) if arch == "llama" else gpt2(0.1)
    model = tpkit.parallelize(base, comm=comm, mode="training").train()
    tpkit.recompute(model, "full")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = tpkit.watch_replicas(model, opt, every=1)
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(2):  # gradient accumulation over two micro-batches
            ids = torch.randint(0, 1000, (2, 12), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=ids).logits
            loss = vocab_parallel_cross_entropy(logits[:, :-1].float(), ids[:, 1:], vocab_size=1000) / 2
            loss.backward()
        tpkit.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return watch.checks


def soak_each(archs: list[str], steps: int) -> list[int]:
    """`soak_body` of each architecture, one after the other on the same ranks."""
    return [soak_body(arch, steps) for arch in archs]
