"""`from_pretrained`'s build (`allocate.meta_parameters`): parameters on meta with their initializers skipped (nothing
to write there), while real tensors (the buffers, another thread's model) are initialized as ever."""
from __future__ import annotations

import threading

import torch
import transformers

from tpkit.checkpoint.allocate import meta_parameters
from tpkit.checkpoint.pretrained import build


def test_initializers_skip_meta_tensors_only():
    real, other_thread = torch.zeros(64), torch.zeros(64)
    with meta_parameters(torch.float32):
        linear = torch.nn.Linear(8, 4)
        assert linear.weight.is_meta and torch.nn.init.normal_(linear.weight) is linear.weight
        torch.nn.init.normal_(real)
        worker = threading.Thread(target=lambda: torch.nn.init.uniform_(other_thread, 1.0, 2.0))
        worker.start()
        worker.join()
    assert real.abs().sum() > 0 and bool((other_thread >= 1.0).all())
    after = torch.zeros(4)
    torch.nn.init.ones_(after)  # the mode is gone after the build
    assert after.tolist() == [1.0] * 4


def test_the_build_runs_no_initializer_and_keeps_the_buffers_transformers_computes():
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100)
    with Ops():
        model = build(cfg, None, torch.float32)
    assert ops and not [op for op in ops if op.startswith(("normal_", "uniform_", "fill_"))], sorted(set(ops))
    assert all(p.is_meta for p in model.parameters())
    want = dict(transformers.LlamaForCausalLM(cfg).named_buffers())
    got = dict(model.named_buffers())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
