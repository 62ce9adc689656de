"""Reduction operators, and the local reduction that backends without a native operator fall back on."""
from __future__ import annotations

import enum
from typing import Sequence

import torch


class ReduceOp(str, enum.Enum):
    """How a reducing collective combines the ranks' tensors.

    AVG on integer tensors divides with truncation toward zero, as NCCL does.
    """

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"

    @classmethod
    def parse(cls, op: "ReduceOp | str") -> "ReduceOp":
        """Accept a ReduceOp, its name or value in any case (`"sum"`, `"SUM"`); reject anything else."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            key = op.strip().lower()
            for member in cls:
                if key in (member.value, member.name.lower()):
                    return member
        valid = ", ".join(m.name for m in cls)
        raise ValueError(f"unknown reduce op {op!r}; valid ops are {valid}")


def divide_by_count(total: torch.Tensor, count: int) -> torch.Tensor:
    """The average from a sum, in place: float division for floating types, truncation for integers."""
    if total.is_floating_point() or total.is_complex():
        return total.div_(count)
    return total.div_(count, rounding_mode="trunc")


def reduce_tensors(tensors: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Combine tensors in list order into a new tensor.

    The fixed order makes the result bitwise identical on every rank that computes it from the same list,
    which is what a real all-reduce guarantees too.
    """
    acc = tensors[0].clone()
    for t in tensors[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc.add_(t)
        elif op is ReduceOp.PRODUCT:
            acc.mul_(t)
        elif op is ReduceOp.MAX:
            torch.maximum(acc, t, out=acc)
        elif op is ReduceOp.MIN:
            torch.minimum(acc, t, out=acc)
        else:  # pragma: no cover - ReduceOp is closed
            raise ValueError(f"unknown reduce op {op!r}")
    if op is ReduceOp.AVG:
        divide_by_count(acc, len(tensors))
    return acc
