"""`torch.compile(converted, fullgraph=True)` forward and backward, and the device-side id checks.

Converted tiny Llama and GPT-2 at world size 2 compile with no graph break (fullgraph=True raises on one) on
thread-ranks (custom ops keyed by the communicator id) and gloo processes (shared-memory custom ops, and
functional collectives with TPKIT_SHM=0); outputs and gradients equal eager.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import tpkit
from tpkit.convert import parallelize
from tpkit.nn import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

from tests.models.hf import hf_model, inputs

torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)


def _compare(model: nn.Module, ids: torch.Tensor, backend: str = "aot_eager") -> tuple[float, float]:
    """(max |compiled - eager| of the logits, of every gradient) on one rank."""
    ref = model(input_ids=ids).logits
    ref.square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    out = torch.compile(model, fullgraph=True, backend=backend)(input_ids=ids).logits
    out.square().mean().backward()
    grad_err = max((p.grad - want[n]).abs().max().item() for n, p in model.named_parameters())
    return (out - ref).abs().max().item(), grad_err


def _threads_body(base: nn.Module) -> tuple[float, float]:
    return _compare(parallelize(copy.deepcopy(base), comm=tpkit.get_communicator()), inputs())


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_compile_fullgraph_threads(name):
    torch._dynamo.reset()
    base = hf_model(name)
    for logit_err, grad_err in tpkit.launch(_threads_body, 2, backend="threads", args=(base,)):
        assert logit_err < 1e-5 and grad_err < 1e-5


def _gloo_body() -> dict:
    comm = tpkit.get_communicator()
    ids = inputs()
    out = {"llama_shm": _compare(parallelize(hf_model("llama"), comm=comm), ids), "shm": comm.shared_memory}
    os.environ["TPKIT_SHM"] = "0"  # a communicator made now has no faster transport: functional collectives
    plain = comm.new_group([0, 1])
    out["gpt2_functional"] = _compare(parallelize(hf_model("gpt2"), comm=plain), ids)
    out["functional_group"] = plain.__dict__.get("_functional_group")
    return out


def test_compile_fullgraph_gloo_processes():
    for result in tpkit.launch(_gloo_body, 2, backend="gloo", timeout=240):
        assert result["shm"] is True and result["functional_group"] is not None
        for key in ("llama_shm", "gpt2_functional"):
            assert max(result[key]) < 1e-5, (key, result[key])


def _inductor_body(mlp: nn.Sequential, x: torch.Tensor) -> tuple[float, float]:
    comm = tpkit.get_communicator()
    up = ColumnParallelLinear.from_module(mlp[0], comm=comm)
    down = RowParallelLinear.from_module(mlp[2], comm=comm)
    tp = nn.Sequential(up, nn.GELU(), down)
    ref = tp(x)
    ref.sum().backward()
    want = [p.grad.clone() for p in tp.parameters()]
    tp.zero_grad(set_to_none=True)
    y = torch.compile(tp, fullgraph=True, backend="inductor")(x)
    y.sum().backward()
    return (y - ref).abs().max().item(), max((p.grad - w).abs().max().item() for p, w in zip(tp.parameters(), want))


def test_compile_inductor_mlp_threads():
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16))
    x = torch.randn(3, 16, requires_grad=False)
    for out_err, grad_err in tpkit.launch(_inductor_body, 2, backend="threads", args=(mlp, x)):
        assert out_err < 1e-5 and grad_err < 1e-5


def _range_body(table: nn.Embedding, debug: bool) -> str:
    from tpkit.nn import embedding as embedding_module

    comm = tpkit.get_communicator()
    layer = VocabParallelEmbedding.from_module(table, comm=comm)
    good, bad = torch.tensor([[1, 2, 10]]), torch.tensor([[1, 2, 11]])
    calls = []
    real = embedding_module._describe_ids
    embedding_module._describe_ids = lambda *a: (calls.append(1), real(*a))[1]
    try:
        assert torch.equal(layer(good), table(good).detach())
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(good), table(good).detach())
        messages = []
        for fn in (layer, compiled):
            try:
                fn(bad)
            except (RuntimeError, IndexError) as exc:
                messages.append(f"{type(exc).__name__}: {exc}")
            else:
                messages.append("no error")
        return messages, len(calls)
    finally:
        embedding_module._describe_ids = real


def test_out_of_range_ids_raise_eager_and_compiled(monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(0)
    table = nn.Embedding(11, 4)
    monkeypatch.delenv("TP_DEBUG", raising=False)
    for (eager, compiled), calls in tpkit.launch(_range_body, 2, backend="threads", args=(table, False)):
        assert calls == 0  # the descriptive checks stay off without TP_DEBUG
        assert "RuntimeError" in eager and "ids must be in 0..10" in eager
        assert "RuntimeError" in compiled and "ids must be in 0..10" in compiled
    monkeypatch.setenv("TP_DEBUG", "1")
    for (eager, compiled), calls in tpkit.launch(_range_body, 2, backend="threads", args=(table, True)):
        assert calls >= 2  # eager calls only: a compiled graph never runs them
        assert eager.startswith("IndexError") and "[11]" in eager
        assert "RuntimeError" in compiled and "ids must be in 0..10" in compiled
