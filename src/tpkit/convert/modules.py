"""Module-type predicates: what kind of layer a module is, judged by its class and its forward, not its name.

A subclass that overrides `forward` is not the layer its base class says (OPT's learned positional embedding
adds an offset, for example), so the checks below accept a subclass only when it keeps the base forward.
"""
from __future__ import annotations

import copy

import functools

import torch
from torch import nn

from .transformers_threads import transformers_name


def _keeps_forward(m: nn.Module, base: type) -> bool:
    return isinstance(m, base) and type(m).forward is base.forward


def hf_conv1d_class():
    """Hugging Face's `Conv1D` (GPT-2): a linear layer whose weight is stored transposed, (in, out)."""
    try:
        return transformers_name("Conv1D", "pytorch_utils")
    except Exception:  # noqa: BLE001 - transformers is optional
        return None


def is_transposed_linear(m: nn.Module) -> bool:
    cls = hf_conv1d_class()
    return cls is not None and _keeps_forward(m, cls)


# nn.Linear subclasses whose own forward computes exactly `x @ weight.T + bias` (checked by a test against
# F.linear), so a split Linear replaces them as it replaces nn.Linear. Keyed by class (module.qualname).
LINEAR_FORWARDS = frozenset({"transformers.models.falcon.modeling_falcon.FalconLinear",
                             "tpkit.nn.decode_linear.DecodeLinear"})  # (a whole layer of a converted model)


def is_linear(m: nn.Module) -> bool:
    """nn.Linear (or a subclass in LINEAR_FORWARDS), or GPT-2's Conv1D (the same map, weight transposed)."""
    return (_keeps_forward(m, nn.Linear) or is_transposed_linear(m) or
            (isinstance(m, nn.Linear) and f"{type(m).__module__}.{type(m).__qualname__}" in LINEAR_FORWARDS))


def linear_dims(m: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a linear-like module."""
    if is_transposed_linear(m):
        return int(m.weight.shape[0]), int(m.weight.shape[1])
    return int(m.in_features), int(m.out_features)


def as_linear(m: nn.Module) -> nn.Linear:
    """An `nn.Linear` computing what `m` computes (GPT-2's Conv1D stores the weight transposed)."""
    if not is_transposed_linear(m):
        return m
    n_in, n_out = linear_dims(m)
    lin = nn.Linear(n_in, n_out, bias=m.bias is not None, device="meta")
    lin.weight = nn.Parameter(m.weight.detach().t(), requires_grad=m.weight.requires_grad)
    if m.bias is not None:
        lin.bias = nn.Parameter(m.bias.detach(), requires_grad=m.bias.requires_grad)
    return lin


def is_conv2d(m: nn.Module) -> bool:
    return _keeps_forward(m, nn.Conv2d)


def is_plain_conv2d(m: nn.Module) -> bool:
    """A Conv2d that can be split by channels: no groups (depthwise convs mix nothing across channels, and
    are handled as per-channel only when paired, which we do not attempt)."""
    return is_conv2d(m) and m.groups == 1


def is_embedding(m: nn.Module) -> bool:
    """nn.Embedding, or one whose forward only scales its output by a scalar buffer (Gemma's)."""
    return _keeps_forward(m, nn.Embedding) or output_scale(m) is not None


def output_scale(m: nn.Module) -> torch.Tensor | None:
    """The scalar an embedding multiplies its output by, for the Hugging Face `*ScaledWordEmbedding` classes
    whose forward is exactly `super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)` (Gemma and
    25 others) or `super().forward(input_ids) * self.embed_scale` with a number (BART and its kin); None for any
    other module."""
    scale = getattr(m, "embed_scale", None)
    if not isinstance(m, nn.Embedding) or not _scales_output(type(m)):
        return None
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        return scale
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return torch.tensor(float(scale), dtype=torch.float64)
    return None


@functools.lru_cache(maxsize=None)
def _scales_output(cls: type) -> bool:
    import inspect

    try:
        body = "".join(inspect.getsource(cls.forward).split()[-6:])
    except (OSError, TypeError):
        return False
    return body.endswith(("returnsuper().forward(input_ids)*self.embed_scale.to(self.weight.dtype)",
                          "returnsuper().forward(input_ids)*self.embed_scale"))


def keep_output_scale(old: nn.Module, new: nn.Module) -> nn.Module:
    """`new` (a split embedding built from `old`) scales its output as `old` did (a non-persistent buffer and a
    forward hook, so state_dict keys do not change)."""
    scale = output_scale(old)
    if scale is None:
        return new
    new.register_buffer("embed_scale", scale.detach().clone(), persistent=False)
    new.register_forward_hook(_scale_output)
    return new


def _scale_output(mod: nn.Module, args, out):
    """The forward hook of `keep_output_scale` (a module-level function, so the model pickles)."""
    return out * mod.embed_scale.to(out.dtype)


def is_per_channel(m: nn.Module) -> bool:
    """BatchNorm: every channel is normalised on its own, so it can hold just this rank's channels."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return isinstance(m, _BatchNorm) and type(m).forward is _BatchNorm.forward


def is_scalar_elementwise(m: nn.Module) -> bool:
    """A leaf whose parameters are single numbers and which acts on each element alone (xIELU's alpha_p and
    alpha_n, a PReLU with one slope): a shard of features passes through it as through a plain activation. Judged
    by behaviour on a probe with its real parameters: the output keeps the input's shape, a change of one feature
    changes that feature's output only, and permuting the features permutes the output alike."""
    params = list(m.parameters(recurse=False))
    if not params or any(p.numel() != 1 for p in params) or any(True for _ in m.children()):
        return False
    if params[0].is_meta:  # a model built on meta (to be loaded): probe a copy holding 0.5 everywhere
        m = copy.deepcopy(m).to_empty(device="cpu")
        with torch.no_grad():
            for t in list(m.parameters()) + list(m.buffers()):
                t.fill_(0.5)
        params = list(m.parameters(recurse=False))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=g, dtype=torch.float64).to(dtype=params[0].dtype, device=params[0].device)
    moved = x.clone()
    moved[..., 3] += 1
    perm = torch.randperm(8, generator=g).to(x.device)
    try:
        with torch.no_grad():
            y, y_moved, y_perm = m(x), m(moved), m(x[..., perm])
    except Exception:  # noqa: BLE001 - a forward that needs more than a tensor is no activation
        return False
    if not all(isinstance(t, torch.Tensor) and t.shape == x.shape for t in (y, y_moved, y_perm)):
        return False
    others = [i for i in range(8) if i != 3]
    return bool(torch.equal(y[..., others], y_moved[..., others]) and torch.equal(y[..., perm], y_perm))


def is_feature_norm(m: nn.Module) -> bool:
    """A per-token norm over the last dim only (LayerNorm, RMSNorm, HF's *RMSNorm / T5LayerNorm): each token's
    output depends on that token's features alone, so it runs unchanged on a slice of the sequence but needs
    the whole feature vector.

    Judged by type and behaviour, not name: nn.LayerNorm / nn.RMSNorm over one dim; otherwise a leaf whose only
    parameters are a `weight` (and `bias`) of shape [hidden], whose class calls itself a norm, and which (when
    its weights are real) behaves as one on a probe: tokens do not mix and each token's scale cancels.
    GroupNorm, BatchNorm and InstanceNorm normalise over channels or the batch, never per token."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.instancenorm import _InstanceNorm

    if isinstance(m, (nn.GroupNorm, _BatchNorm, _InstanceNorm, nn.LocalResponseNorm)):
        return False
    if isinstance(m, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
        return len(m.normalized_shape) == 1
    params = dict(m.named_parameters(recurse=False))
    weight = params.get("weight")
    if ("norm" not in type(m).__name__.lower() or weight is None or weight.dim() != 1 or list(m.children())
            or set(params) - {"weight", "bias"} or ("bias" in params and params["bias"].shape != weight.shape)):
        return False
    return weight.is_meta or _normalises_each_token(m, int(weight.shape[0]), weight.dtype, weight.device)


def _normalises_each_token(m: nn.Module, hidden: int, dtype, device) -> bool:
    """Probe: changing one token leaves the others' outputs alone, and scaling one token changes nothing."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, hidden, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    other = x.clone()
    other[:, 0] = torch.randn(2, hidden, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    scaled = x.clone()
    scaled[:, 1] *= 4
    try:
        with torch.no_grad():
            y, y_other, y_scaled = m(x), m(other), m(scaled)
    except Exception:  # noqa: BLE001 - a forward that needs more than a tensor is not a plain norm
        return False
    if not all(isinstance(t, torch.Tensor) and t.shape == x.shape for t in (y, y_other, y_scaled)):
        return False
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    scale = y.abs().max().clamp_min(1e-12)
    return bool((y_other[:, 1:] - y[:, 1:]).abs().max() <= tol * scale
                and (y_scaled - y).abs().max() <= tol * scale and (y - x).abs().max() > tol * scale)


def kind(m: nn.Module) -> str:
    """A short type label for reports."""
    if is_transposed_linear(m):
        return "Conv1D (transposed linear)"
    return type(m).__name__


def is_per_head_source(m: nn.Module, num_heads: int) -> bool:
    """A layer that can be split with the heads: an embedding with one column per head."""
    return is_embedding(m) and m.embedding_dim == num_heads and isinstance(m.weight, torch.Tensor)
