"""One architecture of the zoo sweep: build it shrunk (`sweep_build`), run it once unconverted, convert it with
plan="auto" on 2 and 3 thread-ranks in float64, compare every output tensor and every gradient with the unconverted
model's (`tests/models/stepcheck.py`, the coverage tests' own check).

Outcomes: `exact` (converted, something split, equal), `whole` (converted, equal, nothing split: the reasons
say why), `refused` (a PlanError before any change), `crashed` (any other error in conversion or the converted
forward / backward), `wrong` (converted, but an error above the tolerance), `skipped` (cannot be built or run
tiny on CPU; the reason). The tolerance is 1e-9 relative; a model whose own float64 forward computes in a lower
precision somewhere (a norm cast to float32) is compared at 1e-4, and the row says so.
"""
from __future__ import annotations

import copy
import re
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "src"), str(ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

TOL, LOW_PRECISION_TOL = 1e-9, 1e-4
WORLDS = (2, 3)
FIELDS = ("task", "model_type", "cls", "outcome", "share2", "share3", "err2", "err3", "tol", "params", "whole",
          "detail", "seconds")


class _LowPrecision(TorchDispatchMode):
    """Notes whether any op made a floating tensor below float64."""

    found = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                self.found = True
        return out


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return re.sub(r"\s+", " ", text)[:240]


def whole_reasons(model, plan) -> str:
    """What stays whole, by reason (layer numbers folded), largest share of the parameters first:
    `reason (percent)` joined by ' || '."""
    sizes = {n: sum(p.numel() for p in m.parameters(recurse=False)) for n, m in model.named_modules()}
    total = max(sum(p.numel() for p in model.parameters()), 1)
    by_reason: dict[str, int] = {}
    for name, style in plan.entries.items():
        if style == "replicate":
            reason = re.sub(r"\d+", "N", plan.reasons.get(name, "planned whole"))
            by_reason[reason] = by_reason.get(reason, 0) + sizes.get(name, 0)
    ranked = sorted(by_reason.items(), key=lambda kv: -kv[1])
    return " || ".join(f"{r} ({100 * n / total:.1f}%)" for r, n in ranked if n)


def _reference(model, x):
    from tests.models import stepcheck

    mode = _LowPrecision()
    with torch.no_grad(), mode:
        stepcheck.call(copy.deepcopy(model), x)
    ref = stepcheck.reference(model, x)
    bad = [k for k, v in {**ref["outputs"], **ref["grads"]}.items() if not torch.isfinite(v).all()]
    if bad:
        raise ValueError(f"the unconverted model's output or gradient {bad[0]!r} is not finite at this size")
    return ref, mode.found


def _convert(model, x, ref, world: int):
    import tpkit
    from tests.models import stepcheck

    copies = [copy.deepcopy(model) for _ in range(world)]
    results = tpkit.launch(stepcheck.rank_errors, world, backend="threads", args=(copies, x, ref))
    # outputs and gradients; not the weights after the AdamW step, which turns the rounding noise of a gradient
    # that is zero in theory (a key bias) into a step of about lr * noise / eps
    err = max((max((v for k, v in r["errors"].items() if not k.startswith("step ")), default=0.0)
               for r in results), default=0.0)
    return err, max(r["share"] for r in results), results[0]["plan"]


def run_one(task: str, model_type: str, cls: str) -> dict:
    """The sweep's row for one class."""
    import sweep_build
    from tpkit.convert.errors import PlanError

    row = dict.fromkeys(FIELDS, "")
    row.update(task=task, model_type=model_type, cls=cls)
    start = time.perf_counter()
    try:
        model = sweep_build.build(model_type, cls)
        x = sweep_build.inputs(model, task)
        ref, low = _reference(model, x)
    except Exception as exc:  # noqa: BLE001 - what cannot build or run tiny on CPU is skipped, with the reason
        row.update(outcome="skipped", detail=_short(exc), seconds=f"{time.perf_counter() - start:.1f}")
        return row
    tol = LOW_PRECISION_TOL if low else TOL
    row.update(params=sum(p.numel() for p in model.parameters()), tol=tol, outcome="exact")
    for world in WORLDS:
        try:
            err, share, plan = _convert(model, x, ref, world)
        except PlanError as exc:
            row.update(outcome="refused", detail=_short(exc))
            break
        except Exception as exc:  # noqa: BLE001 - a crash is a finding
            row.update(outcome="crashed", detail=f"at {world} ranks: {_short(exc)}")
            break
        row[f"err{world}"], row[f"share{world}"] = f"{err:.2e}", f"{share:.4f}"
        if world == 2:
            row["whole"] = whole_reasons(model, plan)
        if not err <= tol:
            row.update(outcome="wrong", detail=f"at {world} ranks: relative error {err:.2e} > {tol:g}")
            break
    if row["outcome"] == "exact" and row["share2"] and float(row["share2"]) >= 0.9999:
        row["outcome"] = "whole"
    row["seconds"] = f"{time.perf_counter() - start:.1f}"
    return row
