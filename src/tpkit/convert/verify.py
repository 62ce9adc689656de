"""`verify(model_fn, example_inputs, world_size, plan)`: prove a plan by running it.

The plan runs on `world_size` thread-ranks in this process (no GPUs needed: a plan for 64 devices can be
checked on a laptop) and every output, and with `backward=True` every gradient shard, is compared with the
unconverted model. Each rank converts its own deep copy of one model, so all ranks and the reference start
from the same weights.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..tables import Column, render_table
from .layouts import shard_layouts
from .plan import check_plan_argument


@dataclasses.dataclass
class OutputCheck:
    """One output or gradient: its largest absolute error over ranks, that error relative to the reference's
    largest magnitude, and the absolute error it was allowed (`tolerance`, see `verify`)."""

    name: str
    shape: tuple
    max_abs_error: float
    max_rel_error: float
    ok: bool
    tolerance: float = 0.0


@dataclasses.dataclass
class VerifyReport:
    """Per output (and per gradient, with backward) the largest absolute and relative error over ranks."""

    ok: bool
    max_abs_error: float
    world_size: int
    outputs: list[OutputCheck]
    gradients: list[OutputCheck]
    rtol: float
    plan: dict

    def summary(self, width: int | None = None) -> str:
        """A table of every output and gradient checked (fitted to `width` columns; None: natural width)."""
        columns = [Column("tensor", "left", wrap="names"), Column("shape", drop=1), Column("abs error"),
                   Column("allowed"), Column("rel error", drop=2), Column("ok", "left")]
        rows = [[f"{kind} {c.name}", "x".join(map(str, c.shape)), f"{c.max_abs_error:.3g}", f"{c.tolerance:.3g}",
                 f"{c.max_rel_error:.3g}", "ok" if c.ok else "FAIL"]
                for kind, checks in (("output", self.outputs), ("grad", self.gradients)) for c in checks]
        title = (f"verify: {'PASS' if self.ok else 'FAIL'} at world size {self.world_size} (relative tolerance "
                 f"{self.rtol:g}); max abs error {self.max_abs_error:.3g}")
        return render_table(title, columns, rows, width)

    def __str__(self) -> str:
        return self.summary()


def named_tensors(out: Any, prefix: str = "output") -> dict[str, torch.Tensor]:
    """The floating-point tensors of a (nested) model output, by path."""
    found: dict[str, torch.Tensor] = {}
    if isinstance(out, torch.Tensor):
        if out.is_floating_point():
            found[prefix] = out
    elif isinstance(out, Mapping):
        for k, v in out.items():
            found.update(named_tensors(v, f"{prefix}.{k}" if prefix != "output" else str(k)))
    elif isinstance(out, (list, tuple)):
        for i, v in enumerate(out):
            found.update(named_tensors(v, f"{prefix}[{i}]"))
    return found


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _default_loss(outputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """A loss that touches every output element with a different weight (a plain sum would hide errors
    that cancel), the same on every rank."""
    total = 0.0
    for t in outputs.values():
        g = torch.Generator().manual_seed(1234)
        w = torch.randn(t.shape, generator=g, dtype=t.dtype, device="cpu").to(t.device)
        total = total + (t * w).sum()
    return total


def _abs_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference (inf when the shapes differ)."""
    if got.shape != ref.shape:
        return float("inf")
    return (got.detach().double() - ref.detach().double()).abs().max().item() if ref.numel() else 0.0


def _magnitude(t: torch.Tensor) -> float:
    return t.detach().double().abs().max().item() if t.numel() else 0.0


def _check(name: str, ref: torch.Tensor, errors: list[float], rtol: float, atol: float) -> OutputCheck:
    """Judge one tensor as `torch.testing.assert_close` does: pass when the largest error is at most
    `atol + rtol * max|ref|`."""
    scale = _magnitude(ref)
    err = max(errors)
    tolerance = atol + rtol * scale
    rel = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
    return OutputCheck(name, tuple(ref.shape), err, rel, err <= tolerance, tolerance)


def verify(model_fn: Callable[[], nn.Module] | nn.Module, example_inputs: Any, world_size: int = 4,
           plan: Any = "auto", backward: bool = False, *, rtol: float = 1e-4, mode: str = "inference",
           loss_fn: Callable[[Any], torch.Tensor] | None = None) -> VerifyReport:
    """Run `plan` on `world_size` thread-ranks and compare with the original model.

    `model_fn`: a module, or a function returning one (called once; ranks get deep copies). Each tensor is
    judged the way `torch.testing.assert_close` judges it: it passes when its largest absolute error is at
    most `atol + rtol * max|reference|`. For outputs `atol` is 0. For a gradient, `atol` is `rtol` times the
    largest gradient of the same layer, or 1e-3 of the model's largest gradient if that is larger: some
    gradients are zero in theory (a conv bias before BatchNorm, a key bias) and hold only the rounding noise of
    sums whose terms are as large as the layer's other gradients, so ~0 is no scale to judge them by; and a
    layer whose output barely moves the loss (q/k of a near-uniform attention) has nothing but such noise.
    The report gives each tensor's error and the error it was allowed.
    `loss_fn(outputs) -> scalar` for backward (default: a fixed random weighting of every floating output).
    """
    from ..comm import run_threads
    from ..distributed import use_communicator
    from .parallelize import parallelize

    check_plan_argument(plan, "verify")
    model = model_fn if isinstance(model_fn, nn.Module) else model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"verify: model_fn must be an nn.Module or return one, got {type(model).__name__}")
    copies = [copy.deepcopy(model) for _ in range(world_size)]
    reference = copy.deepcopy(model)
    loss = loss_fn or (lambda out: _default_loss(named_tensors(out)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ref_out = _call(reference, example_inputs)
        if backward:
            loss(ref_out).backward()
    ref_tensors = {k: v.detach() for k, v in named_tensors(ref_out).items()}
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    layer_scale: dict[str, float] = {}
    for n, g in ref_grads.items():
        layer = n.rpartition(".")[0]
        layer_scale[layer] = max(layer_scale.get(layer, 0.0), _magnitude(g))
    model_floor = 1e-3 * max(layer_scale.values(), default=0.0)

    def body(comm):
        with use_communicator(comm):
            m = copies[comm.rank]
            parallelize(m, plan, comm, mode=mode, example_inputs=example_inputs)
            out = _call(m, example_inputs)
            if backward:
                loss(out).backward()
            outs = {k: v.detach() for k, v in named_tensors(out).items()}
            grads = {}
            layouts = shard_layouts(m)
            if backward:
                for n, p in m.named_parameters():
                    full = ref_grads.get(n)
                    if full is None:
                        continue
                    if p.grad is None:  # the parallel model lost this gradient: a failure, never a skip
                        grads[n] = None
                        continue
                    grads[n] = _abs_err(p.grad, layouts[n].shard(full))
            record = getattr(m, "_tp_plan", None) if hasattr(type(m), "tp_plan") else getattr(m, "tp_plan", None)
            return outs, grads, record.to_dict() if record is not None else {}

    results = run_threads(body, world_size)
    outputs = []
    for name, ref in ref_tensors.items():
        errs = [_abs_err(r[0].get(name, torch.empty(0)), ref) for r in results]
        outputs.append(_check(name, ref, errs, rtol, 0.0))
    gradients = []
    for name, ref in ref_grads.items():
        lost = [rank for rank, r in enumerate(results) if name in r[1] and r[1][name] is None]
        errs = [float("inf") if r[1][name] is None else r[1][name] for r in results if name in r[1]]
        if not errs:
            continue
        label = f"{name} (no gradient in the parallel model on rank(s) {lost})" if lost else name
        gradients.append(_check(label, ref, errs, rtol, rtol * max(layer_scale[name.rpartition(".")[0]], model_floor)))
    checks = outputs + gradients
    ok = bool(checks) and all(c.ok for c in checks)
    max_abs = max((c.max_abs_error for c in checks), default=float("nan"))
    return VerifyReport(ok, max_abs, world_size, outputs, gradients, rtol, results[0][2])
