"""`verify`: a lost gradient is a failure, and the transposed-weight check goes by module type."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tpkit.convert import verify


def test_one_tensor_input_is_traced_as_one_argument():
    """A bare tensor as example input is the model's one argument (as verify calls it), not a tuple of rows:
    the auto plan then splits the MLP instead of replicating it for want of a trace."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    report = verify(model, torch.randn(5, 8), world_size=2, backward=True)
    assert report.ok and report.plan["entries"] == {"0": "colwise", "2": "rowwise"}, report.plan
