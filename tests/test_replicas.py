"""The replica sentinel (`tpkit.check_replicas`, `tpkit.watch_replicas`): each injected fault is caught at the first
check after it, naming the tensor; clean training raises nothing.

Faults, each on a tiny Llama with 8 query / 2 KV heads at 2 and 3 ranks (KV rows shared by two ranks at 3):
a replicated norm weight moved one ulp on one rank; a KV row shared by two ranks moved on one of them; one rank's
replicated gradient scaled by (1 + 2^-20); a gradient sum removed; a sequence-parallel norm's gradient sum skipped;
the all-reduce of a column-parallel layer's input gradient dropped from the backward.
"""
from __future__ import annotations

import copy

import pytest
import torch

import tpkit
from tpkit.comm import run_threads
from tpkit.nn import mappings
from tpkit.nn.rewrites import base_class

from tests.models.paths import ARCHS, ids, loss_of


@pytest.fixture(scope="module")
def llama():
    return ARCHS["llama"]()


def _shared_row_holder(model, key: str) -> int:
    """The highest rank holding a row of `key` that another rank holds too."""
    lay = tpkit.shard_layouts(model)[key]
    held = [set(lay.for_rank(r).index()) for r in range(lay.world_size)]
    return max(r for r in range(lay.world_size) if any(held[r] & held[o] for o in range(lay.world_size) if o != r))


def _train_step(model) -> None:
    loss_of(model(input_ids=ids()).logits, ids()).backward()


def _fault(name: str, base, comm) -> str:
    """Inject fault `name` on this rank's copy, run the step it needs, and return the error `check_replicas`
    raises (the empty string when it raises none)."""
    sp = name == "sp_norm_sum_skipped"
    model = tpkit.parallelize(copy.deepcopy(base), comm=comm, mode="training" if sp else "inference",
                              sequence_parallel=sp)
    last = comm.world_size - 1
    if name == "norm_weight_ulp" and comm.rank == last:
        w = model.model.norm.weight
        with torch.no_grad():
            w[3] = torch.nextafter(w[3], torch.tensor(float("inf"), dtype=w.dtype))
    elif name == "shared_kv_row_moved":
        key = "model.layers.1.self_attn.v_proj.weight"
        if comm.rank == _shared_row_holder(model, key):
            with torch.no_grad():
                model.get_parameter(key)[0, 0] += 1e-3
    elif name == "grad_sum_removed":
        k = model.model.layers[0].self_attn.k_proj
        k.__class__ = base_class(k)  # the sum gone, as the meta path once lost it
    elif sp:  # a sequence-parallel norm's sum gone (a script once had to call it after backward)
        norm = model.model.layers[0].post_attention_layernorm
        norm.__class__ = base_class(norm)
    if name not in ("norm_weight_ulp", "shared_kv_row_moved"):
        _train_step(model)
    if name == "grad_scaled" and comm.rank == last:
        model.model.norm.weight.grad.mul_(1 + 2 ** -20)
    try:
        tpkit.check_replicas(model)
    except tpkit.ReplicaError as exc:
        return str(exc)
    return ""


FAULTS = {  # fault -> what the error must name
    "norm_weight_ulp": "model.norm.weight (param",
    "shared_kv_row_moved": "model.layers.1.self_attn.v_proj.weight (param, rows",
    "grad_scaled": "model.norm.weight (grad",
    "grad_sum_removed": "model.layers.0.self_attn.k_proj.weight (grad",
    "sp_norm_sum_skipped": "_layernorm.weight (grad",
    "allreduce_dropped": "(grad",
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_is_caught_naming_the_tensor(llama, fault, world, monkeypatch):
    if fault in ("shared_kv_row_moved", "grad_sum_removed") and world == 2:
        pytest.skip("2 KV heads over 2 ranks: no row is shared, no sum to lose")
    if fault == "allreduce_dropped":  # every rank's column-parallel backward skips its input-gradient all-reduce
        monkeypatch.setattr(mappings._CopyToRegion, "backward", staticmethod(lambda ctx, grad: (grad, None)))
    errors = run_threads(lambda comm: _fault(fault, llama, comm), world)
    assert all(errors), f"{fault} at {world} ranks went unnoticed"
    assert len(set(errors)) == 1, "every rank raises the same error"
    assert FAULTS[fault] in errors[0], errors[0]


def test_clean_steps_pass_and_the_watch_checks_on_schedule(llama):
    def body(comm):
        model = tpkit.parallelize(copy.deepcopy(llama), comm=comm)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        watch = tpkit.watch_replicas(model, opt, every=2)
        for _ in range(4):
            opt.zero_grad()
            _train_step(model)
            opt.step()
        report, checks = watch.last, watch.checks
        watch.remove()
        opt.step()
        return checks, watch.checks, report.tensors, report.bytes

    for checks, after, tensors, nbytes in run_threads(body, 3):
        assert checks == 4 and after == 4  # steps 2 and 4, grads before and params after; none once removed
        assert tensors > 0 and nbytes > 0


def test_the_watch_raises_from_the_step_that_diverged(llama, monkeypatch):
    monkeypatch.setenv("TP_DEBUG", "1")  # every step

    def body(comm):
        model = tpkit.parallelize(copy.deepcopy(llama), comm=comm)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tpkit.watch_replicas(model, opt, every=1000)
        for step in range(3):
            opt.zero_grad()
            _train_step(model)
            if step == 1 and comm.rank == 1:
                model.model.norm.weight.grad.mul_(1 + 2 ** -20)
            try:
                opt.step()
            except tpkit.ReplicaError as exc:
                return step, str(exc)
        return None

    for found in run_threads(body, 2):
        assert found is not None and found[0] == 1 and "model.norm.weight (grad" in found[1]


def test_tolerance_lets_named_nondeterministic_tensors_differ_by_ulps(llama):
    """Exact by default; `tolerance` names tensors a nondeterministic kernel computes (on CUDA, atomics)."""
    def body(comm):
        model = tpkit.parallelize(copy.deepcopy(llama), comm=comm)
        _train_step(model)
        if comm.rank == 1:
            model.model.norm.weight.grad.mul_(1 + 2 ** -40)
        out = []
        for tol in (None, {"model.norm.*": 1e-9}, {"model.norm.*": 1e-14}):
            try:
                report = tpkit.check_replicas(model, tolerance=tol)
                out.append(len(report.tolerated))
            except tpkit.ReplicaError:
                out.append("raised")
        return out

    for got in run_threads(body, 2):
        assert got == ["raised", 1, "raised"], got


def test_an_unconverted_model_and_bad_arguments():
    model = torch.nn.Linear(3, 3)
    assert tpkit.check_replicas(model).tensors == 0
    with pytest.raises(ValueError, match="positive int"):
        tpkit.watch_replicas(model, torch.optim.SGD(model.parameters(), lr=0.1), every=0)


def _dp_body(mode: str) -> list[str]:
    """tp2 x dp2: a clean check, then one TP-replicated norm weight moved on world rank 3 (tp rank 1 of dp replica 1).
    DDP: caught across the dp group (ranks 1 and 3 hold the same TP rank's copies). FSDP2: each dp rank holds its
    own shard, so it is caught across the tp group of the replica that holds the moved element."""
    comm = tpkit.get_communicator()
    tp, dp = tpkit.comm.split(comm, 2)
    model = tpkit.parallelize(ARCHS["llama"](), comm=tp)
    model = tpkit.data_parallel(model, dp, mode=mode)
    inner = model.module if mode == "ddp" else model
    tokens = ids()[dp.rank:dp.rank + 1]
    loss_of(model(input_ids=tokens).logits, tokens).backward()
    out = [tpkit.check_replicas(model).summary()]
    if comm.rank == 3:
        w = inner.model.norm.weight
        local = w.to_local() if hasattr(w, "to_local") else w
        with torch.no_grad():
            local[0] += 1e-3
    try:
        tpkit.check_replicas(model)
        out.append("")
    except tpkit.ReplicaError as exc:
        out.append(str(exc))
    return out


def _dp_bodies(modes: list[str]) -> dict[str, list[str]]:
    """`_dp_body` of each mode, one after the other in the same processes (fresh model and groups each)."""
    return {mode: _dp_body(mode) for mode in modes}


DP_MODES = ["ddp", "fsdp"]


@pytest.fixture(scope="module")
def dp_runs() -> list[dict[str, list[str]]]:
    """One start of the 4 gloo processes for both data-parallel modes: per rank, {mode: `_dp_body(mode)`}."""
    return tpkit.launch(_dp_bodies, 4, backend="gloo", args=(DP_MODES,), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("mode", DP_MODES)
def test_data_parallel_replicas_are_checked(dp_runs, mode):
    results = [per_rank[mode] for per_rank in dp_runs]
    want = {"ddp": "dp rank [0] vs dp rank [1]", "fsdp": "tp rank [0] vs tp rank [1]"}[mode]
    for rank, (summary, error) in enumerate(results):
        assert "agree" in summary, summary
        assert error, f"rank {rank} raised nothing"  # every rank of the world raises, not only the finders
        if rank in ((1, 3) if mode == "ddp" else (2, 3)):
            assert "model.norm.weight (param" in error and want in error, error


SOAK_ARCHS = ["llama", "gpt2"]


@pytest.fixture(scope="module")
def soaks() -> list[list[int]]:
    """One start of the 3 gloo processes for both architectures' soaks: per rank, the checks of each."""
    from tests.replica_soak import soak_each

    return tpkit.launch(soak_each, 3, backend="gloo", args=(SOAK_ARCHS, 8), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("arch", SOAK_ARCHS)
def test_clean_training_raises_nothing(soaks, arch):
    """Every step checked with dropout, recompute, accumulation, bf16 autocast and clipping at 3 ranks (KV rows
    shared; GPT-2's residual dropout on replicated activations). bench/replicas.py soak runs 1000 steps at 2 and
    3 ranks."""
    assert [per_rank[SOAK_ARCHS.index(arch)] for per_rank in soaks] == [16] * 3


def test_checkpointer_watches_the_replicas_unless_told_not_to(llama, tmp_path):
    def body(comm, every, tolerance=None):
        model = tpkit.parallelize(copy.deepcopy(llama), comm=comm)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tpkit.Checkpointer(tmp_path / f"ck{every}{tolerance}", every=100, comm=comm, check_replicas_every=every,
                           replica_tolerance=tolerance).resume(model, opt)
        _train_step(model)
        if comm.rank == 1:
            model.model.norm.weight.grad.mul_(1 + 2 ** -20)
        try:
            opt.step()
        except tpkit.ReplicaError as exc:
            return str(exc)
        return ""

    assert all("model.norm.weight (grad" in e for e in run_threads(lambda c: body(c, 1), 2))
    assert run_threads(lambda c: body(c, None), 2) == ["", ""]
    assert run_threads(lambda c: body(c, 1, {"model.norm.weight": 1e-5}), 2) == ["", ""]
