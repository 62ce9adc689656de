"""The record of a converted model's parameters survives every path that replaces Parameters or copies the model.

A Llama with 8 query / 2 KV heads, float64, one backward against ONE process of plain transformers: at 3 ranks a KV
head's rows are held by two ranks (their gradients summed over the holders, their norm counted once), and with
sequence parallelism every norm sees a slice of the sequence (its gradient summed over the ranks in the backward).
After `load_state_dict(assign=True)`, `copy.deepcopy` and `torch.save` / `torch.load` of the whole module, each
rank's gradients (sliced from the reference's by `shard_layouts`) and `clip_grad_norm_`'s total norm equal the one
process's, on thread-ranks and gloo processes. (Llama's RMSNorm computes in float32 inside: rel 1e-6.)
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import tpkit

from .helpers import copied

transformers = pytest.importorskip("transformers")

TOL, VOCAB, SEQ, MAX_NORM = 1e-6, 96, 6, 0.05
PATHS = ("as converted", "assign=True", "deepcopy", "torch.save")


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32)
    config._attn_implementation = "sdpa"
    torch.manual_seed(11)
    return transformers.LlamaForCausalLM(config).double()


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


def reference(model: torch.nn.Module) -> dict:
    """One process of plain transformers: the gradients and the clipped norm."""
    model = copy.deepcopy(model)
    ids = batch()
    logits = model(input_ids=ids).logits
    F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return dict(grads=grads, norm=float(norm))


def through(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """The converted `model` after a path users take."""
    if path == "assign=True":
        model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)
    elif path != "as converted":
        model = copied(model, path)
    return model


def one_rank(base: torch.nn.Module, comm, sp: bool, path: str) -> dict:
    model = tpkit.parallelize(copy.deepcopy(base), comm=comm, mode="training", sequence_parallel=sp)
    model = through(model, path)
    ids = batch()
    model(input_ids=ids, labels=ids).loss.backward()
    layouts = tpkit.shard_layouts(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = tpkit.clip_grad_norm_(model.parameters(), MAX_NORM)
    return dict(grads=grads, layouts=layouts, norm=float(norm))


def off(results: list[dict], ref: dict) -> list[str]:
    """What differs from the one process (empty: nothing)."""
    bad = []
    for rank, got in enumerate(results):
        if abs(got["norm"] - ref["norm"]) > TOL * ref["norm"]:
            bad.append(f"rank {rank}: total norm {got['norm']:.10g} vs {ref['norm']:.10g}")
        for n, g in got["grads"].items():
            want = got["layouts"][n].shard(ref["grads"][n])
            err = float((g - want).abs().max() / want.abs().max().clamp_min(1e-30))
            if not err <= TOL:
                bad.append(f"rank {rank}: {n} gradient rel {err:.2e}")
    return bad


@pytest.fixture(scope="module")
def base():
    return llama()


@pytest.fixture(scope="module")
def ref(base):
    return reference(base)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world,sp", [(2, True), (3, False), (3, True)],
                         ids=["2 ranks sequence parallel", "3 ranks KV rows shared", "3 ranks sequence parallel"])
def test_gradients_and_norm_equal_one_process_on_threads(base, ref, world, sp, path):
    results = tpkit.run_threads(lambda comm: one_rank(base, comm, sp, path), world)
    bad = off(results, ref)
    assert not bad, "\n".join(bad[:10])


def _gloo_cases(world: int) -> list[tuple[bool, str, list[str]]]:
    comm = tpkit.init()
    base, out = llama(), []
    ref = reference(base) if comm.rank == 0 else None
    for sp in ((True,) if world == 2 else (False, True)):
        for path in PATHS:
            got = one_rank(base, comm, sp, path)
            gathered = [None] * world
            torch.distributed.all_gather_object(gathered, got)
            if comm.rank == 0:
                out.append((sp, path, off(gathered, ref)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_gradients_and_norm_equal_one_process_on_gloo(world):
    cases = tpkit.launch(_gloo_cases, world, backend="gloo", args=(world,))[0]
    bad = [f"sp={sp} {path}: {b}" for sp, path, found in cases for b in found]
    assert len(cases) == (4 if world == 2 else 8) and not bad, "\n".join(bad[:10])


def test_a_record_holds_no_fact_on_the_tensors(base):
    """Nothing tpkit relies on is an attribute of a Parameter: a converted model's Parameters carry only what
    torch put there."""
    def body(comm):
        model = tpkit.parallelize(copy.deepcopy(base), comm=comm, mode="training", sequence_parallel=True)
        return {n: sorted(vars(p)) for n, p in model.named_parameters() if vars(p)}
    assert tpkit.run_threads(body, 2) == [{}, {}]


def test_bare_parameters_of_two_models_on_different_groups_are_refused(base):
    def body(comm):
        tp, dp = tpkit.comm.split(comm, 2)
        a = tpkit.parallelize(copy.deepcopy(base), comm=tp, mode="training")
        b = tpkit.parallelize(copy.deepcopy(base), comm=dp, mode="training")
        ids = batch()
        for m in (a, b):
            m(input_ids=ids, labels=ids).loss.backward()
        with pytest.raises(ValueError, match="converted on different tensor-parallel groups"):
            tpkit.clip_grad_norm_(list(a.parameters()) + list(b.parameters()), 1.0)
        with pytest.raises(ValueError, match="leave comm out"):
            tpkit.clip_grad_norm_(a.parameters(), 1.0, comm=dp)
        return True
    assert all(tpkit.run_threads(body, 4))


def test_unpickling_without_the_group_says_what_to_create(base):
    def body(comm):
        tp, _ = tpkit.comm.split(comm, 2)
        model = tpkit.parallelize(copy.deepcopy(base), comm=tp, mode="training")
        buffer = io.BytesIO()
        torch.save(model, buffer)
        return buffer.getvalue()
    saved = tpkit.run_threads(body, 4)[2]  # rank 2: rank 0 of the group world[2, 3]
    with pytest.raises(RuntimeError, match=r"pickled on rank 0 of group world\[2, 3\]"):
        torch.load(io.BytesIO(saved), weights_only=False)


def test_a_converted_model_is_freed_when_dropped(base):
    """The record refers to its model weakly: `del model` frees it at once (no cycle for the collector to find),
    under data parallelism's facts too; copies and pickles still refer to their own model."""
    import gc
    import weakref

    def body(comm):
        gc.disable()
        try:
            model = tpkit.parallelize(copy.deepcopy(base), comm=comm, mode="training")
            twin = copy.deepcopy(model)
            assert tpkit.nn.record_of(twin).owner is twin and tpkit.nn.record_of(model).owner is model
            gone = weakref.ref(model)
            del model
            return gone() is None
        finally:
            gc.enable()

    assert all(tpkit.run_threads(body, 2))
