"""Module-type predicates: what kind of layer a module is, judged by its class and its forward, not its name.

A subclass that overrides `forward` is not the layer its base class says (OPT's learned positional embedding
adds an offset, for example), so the checks below accept a subclass only when it keeps the base forward.
"""
from __future__ import annotations

from torch import nn


def _keeps_forward(m: nn.Module, base: type) -> bool:
    return isinstance(m, base) and type(m).forward is base.forward


def hf_conv1d_class():
    """Hugging Face's `Conv1D` (GPT-2): a linear layer whose weight is stored transposed, (in, out)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # noqa: BLE001 - transformers is optional
        return None
    return Conv1D


def is_transposed_linear(m: nn.Module) -> bool:
    cls = hf_conv1d_class()
    return cls is not None and _keeps_forward(m, cls)


def is_linear(m: nn.Module) -> bool:
    """nn.Linear, or GPT-2's Conv1D (the same map with the weight transposed)."""
    return _keeps_forward(m, nn.Linear) or is_transposed_linear(m)


def linear_dims(m: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a linear-like module."""
    if is_transposed_linear(m):
        return int(m.weight.shape[0]), int(m.weight.shape[1])
    return int(m.in_features), int(m.out_features)


def is_conv2d(m: nn.Module) -> bool:
    return _keeps_forward(m, nn.Conv2d)


def is_plain_conv2d(m: nn.Module) -> bool:
    """A Conv2d that can be split by channels: no groups (depthwise convs mix nothing across channels, and
    are handled as per-channel only when paired, which we do not attempt)."""
    return is_conv2d(m) and m.groups == 1


def is_embedding(m: nn.Module) -> bool:
    return _keeps_forward(m, nn.Embedding)


def is_per_channel(m: nn.Module) -> bool:
    """BatchNorm: every channel is normalised on its own, so it can hold just this rank's channels."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return isinstance(m, _BatchNorm) and type(m).forward is _BatchNorm.forward


def is_feature_norm(m: nn.Module) -> bool:
    """LayerNorm / RMSNorm / GroupNorm and look-alikes: they reduce over the features they normalise."""
    if isinstance(m, (nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
        return True
    return "norm" in type(m).__name__.lower() and not is_per_channel(m)


def kind(m: nn.Module) -> str:
    """A short type label for reports."""
    if is_transposed_linear(m):
        return "Conv1D (transposed linear)"
    return type(m).__name__
