"""Building one rank's `tpkit.nn` layer from a full module, for every style of a plan.

The plain cases go through the layers' own `from_module` (the shared split rule). Attention projections
(whole heads, KV heads replicated when fewer than ranks) and packed projections (GPT-2's `c_attn`, packed
gate_up) need rows picked piece by piece: `from_module(index=..., partition_sizes=...)` takes them, and
`param.partition_index` records which rows of the full weight they are.
`local_shapes` says the same thing without building anything (the analyzer's bytes per rank).
"""
from __future__ import annotations


import torch
from torch import nn

from ..comm import split_range, split_sizes
from .heads import feature_index, head_layout
from .modules import is_conv2d, is_embedding, is_per_channel, is_transposed_linear, linear_dims


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


def column_rows(details: dict, n_out: int, world: int, rank: int) -> list[int] | None:
    """Rows of the full weight that `rank` holds for a column-wise layer, or None for the plain split."""
    role = details.get("role")
    pieces = details.get("pieces")
    if details.get("pair") == "attention":
        lay = head_layout(details["num_heads"], details["num_kv_heads"], world, details.get("attention", "attention"))
        hd = details["head_dim"]
        q, kv = lay.q_heads[rank], lay.kv_heads[rank]
        if role == "q":
            return feature_index(q, hd)
        if role in ("k", "v"):
            return feature_index(kv, hd)
        if role == "qkv":
            qw, kw = pieces[0], pieces[1]
            return feature_index(q, hd) + feature_index(kv, hd, qw) + feature_index(kv, hd, qw + kw)
        if role == "qkv_heads":
            return feature_index(q, 3 * hd)
    if pieces and len(pieces) > 1:
        rows, offset = [], 0
        for p in pieces:
            start, end = split_range(p, world, rank)
            rows += list(range(offset + start, offset + end))
            offset += p
        return rows
    return None


def row_cols(details: dict, world: int, rank: int) -> list[int] | None:
    """Input features of the full weight that `rank` holds for a row-wise layer (None: plain split)."""
    if details.get("pair") == "attention":
        lay = head_layout(details["num_heads"], details["num_kv_heads"], world, details.get("attention", "attention"))
        return feature_index(lay.q_heads[rank], details["head_dim"])
    return None


def build_column(m: nn.Module, details: dict, comm, gather: bool = False, sequence_parallel: bool = False) -> nn.Module:
    from ..nn import ColumnParallelConv2d, ColumnParallelLinear

    if is_conv2d(m):
        return ColumnParallelConv2d.from_module(m, comm, gather_output=gather)
    lin = as_linear(m)
    rows = column_rows(details, lin.out_features, comm.world_size, comm.rank)
    if rows is None or gather:
        return ColumnParallelLinear.from_module(lin, comm, gather_output=gather, **_sp(sequence_parallel))
    sizes = column_sizes(details, lin.out_features, comm.world_size)
    layer = ColumnParallelLinear.from_module(lin, comm, index=rows, partition_sizes=sizes, **_sp(sequence_parallel))
    if sum(sizes) > lin.out_features:  # some rows (replicated KV heads) live on several ranks
        _sum_replicated_row_grads(layer, rows, lin.out_features, comm)
        _mark_replicas(layer, details, rows, lin.out_features, comm.world_size)
    return layer


def _mark_replicas(layer: nn.Module, details: dict, rows: list[int], n_out: int, world: int) -> None:
    """Tell `clip_grad_norm_` how many ranks hold each of this rank's rows (`param.partition_replicas`)."""
    holders = [0] * n_out
    for r in range(world):
        for row in column_rows(details, n_out, world, r):
            holders[row] += 1
    replicas = tuple(holders[row] for row in rows)
    for p in (layer.weight, layer.bias):
        if p is not None:
            p.partition_replicas = replicas  # type: ignore[attr-defined]


def column_sizes(details: dict, n_out: int, world: int) -> list[int]:
    """Every rank's number of rows for a column-wise layer (without listing them)."""
    if details.get("pair") == "attention":
        lay = head_layout(details["num_heads"], details["num_kv_heads"], world, details.get("attention", "attention"))
        hd, role = details["head_dim"], details.get("role")
        q = [len(h) * hd for h in lay.q_heads]
        kv = [len(h) * hd for h in lay.kv_heads]
        if role == "qkv_heads":
            return [3 * n for n in q]
        return q if role == "q" else kv if role in ("k", "v") else [a + 2 * b for a, b in zip(q, kv)]
    pieces = details.get("pieces") or [n_out]
    return [sum(per_rank) for per_rank in zip(*(split_sizes(p, world) for p in pieces))]


def _sum_replicated_row_grads(layer: nn.Module, rows: list[int], n_out: int, comm) -> None:
    """Rows held by several ranks (replicated KV heads) get, on each, only the gradient of that rank's query
    heads; the full gradient is their sum, so sum it over the ranks (scatter-add into the full shape, one
    all-reduce, pick the rows back) before any optimizer sees it."""
    idx = torch.tensor(rows, dtype=torch.long)

    def make_hook(param):
        def hook(grad):
            full = grad.new_zeros((n_out,) + tuple(grad.shape[1:]))
            full.index_add_(0, idx.to(grad.device), grad)
            return comm.all_reduce(full).index_select(0, idx.to(grad.device))
        return hook

    for p in (layer.weight, layer.bias):
        if p is not None and p.requires_grad and p.device.type != "meta":
            p.register_hook(make_hook(p))


def _sp(on: bool) -> dict:
    """Sequence parallelism on the [batch, seq, hidden] activations of HF models: the dim before features."""
    return {"sequence_parallel": True, "sequence_dim": -2} if on else {}


def build_row(m: nn.Module, details: dict, comm, input_is_parallel: bool = True,
              sequence_parallel: bool = False) -> nn.Module:
    from ..nn import RowParallelConv2d, RowParallelLinear

    if is_conv2d(m):
        return RowParallelConv2d.from_module(m, comm, input_is_parallel=input_is_parallel)
    lin = as_linear(m)
    cols = row_cols(details, comm.world_size, comm.rank)
    if cols is None or not input_is_parallel:
        return RowParallelLinear.from_module(lin, comm, input_is_parallel=input_is_parallel, **_sp(sequence_parallel))
    lay = head_layout(details["num_heads"], details["num_kv_heads"], comm.world_size, details.get("attention", ""))
    sizes = [len(h) * details["head_dim"] for h in lay.q_heads]
    return RowParallelLinear.from_module(lin, comm, index=cols, partition_sizes=sizes, **_sp(sequence_parallel))


def build_channelwise(m: nn.Module, comm) -> nn.Module:
    """This rank's channels of a BatchNorm (weights, bias and running statistics)."""
    from ..nn import mark_tensor_parallel

    n = m.num_features
    start, end = split_range(n, comm.world_size, comm.rank)
    sizes = split_sizes(n, comm.world_size)
    device = next((t.device for t in list(m.parameters()) + list(m.buffers())), None)
    new = type(m)(end - start, eps=m.eps, momentum=m.momentum, affine=m.affine,
                  track_running_stats=m.track_running_stats, device="meta")
    if device is not None and device.type != "meta":
        new = new.to_empty(device=device)
    for pname in ("weight", "bias"):
        p = getattr(m, pname)
        if p is not None:
            q = nn.Parameter(p.detach()[start:end].clone(), requires_grad=p.requires_grad)
            setattr(new, pname, mark_tensor_parallel(q, 0, sizes))
    for bname in ("running_mean", "running_var"):
        b = getattr(m, bname)
        if b is not None:
            setattr(new, bname, b.detach()[start:end].clone())
    if m.num_batches_tracked is not None:
        new.num_batches_tracked = m.num_batches_tracked.detach().clone()
    new.train(m.training)
    return new


def local_shapes(m: nn.Module, style: str, details: dict, world: int, rank: int) -> dict[str, tuple]:
    """Shapes of the parameters `rank` holds for module `m` under `style` (nothing is built)."""
    full = {n: tuple(p.shape) for n, p in m.named_parameters(recurse=False)}
    if style == "replicate" or world == 1:
        return full
    if is_embedding(m):  # HF's 'colwise' / 'rowwise' on an embedding split its features / its vocabulary
        v, d = full["weight"]
        if style in ("embedding_colwise", "colwise"):
            return {"weight": (v, split_sizes(d, world)[rank])}
        return {"weight": (split_sizes(v, world)[rank], d)}
    if style in ("colwise", "colwise_rep", "vocab_parallel", "rowwise", "rowwise_rep") and not is_conv2d(m):
        n_in, n_out = linear_dims(m)
        if style.startswith("col") or style == "vocab_parallel":
            k = column_sizes(details if style == "colwise" else {}, n_out, world)[rank]
            out = {"weight": (k, n_in)}
            if "bias" in full:
                out["bias"] = (k,)
            return out
        if style == "rowwise" and details.get("pair") == "attention":
            lay = head_layout(details["num_heads"], details["num_kv_heads"], world, details.get("attention", ""))
            k = len(lay.q_heads[rank]) * details["head_dim"]
        else:
            k = split_sizes(n_in, world)[rank]
        out = {"weight": (n_out, k)}
        if "bias" in full:
            out["bias"] = (n_out,)
        return out
    if is_conv2d(m):
        w = full["weight"]
        if style.startswith("col"):
            out = {"weight": (split_sizes(w[0], world)[rank],) + w[1:]}
            if "bias" in full:
                out["bias"] = (out["weight"][0],)
        else:
            out = {"weight": (w[0], split_sizes(w[1], world)[rank]) + w[2:]}
            if "bias" in full:
                out["bias"] = full["bias"]
        return out
    if is_per_channel(m):
        return {n: (split_sizes(s[0], world)[rank],) for n, s in full.items()}
    return full


def local_slice(full: torch.Tensor, param: torch.Tensor, rank: int) -> torch.Tensor:
    """The part of a full tensor (a weight, its gradient, its optimizer state) that `param`, one rank's shard
    built by `parallelize`, corresponds to."""
    index = getattr(param, "partition_index", None)
    dim = getattr(param, "partition_dim", None)
    if index is not None:
        return full.index_select(dim, torch.tensor(index, dtype=torch.long, device=full.device))
    if getattr(param, "tensor_model_parallel", False):
        from ..nn import shard

        return shard(full, dim, param.partition_sizes, rank)
    return full
