"""The plan styles, as data: one small class per style, one registry.

A style says three things about a module (as PyTorch's `tensor/parallel/style.py` keeps one class per style):
which module types it applies to and which sizes it needs (`check`), which part of each of the module's
tensors a rank holds (`layouts`, one `ShardLayout` per parameter and persistent buffer), and which `tpkit.nn`
layer replaces the module (`build`, made from those layouts, so the shard built and the shard described are one
fact). `collectives` names the communication its layer does in the forward. Style names are Hugging Face's
`tp_plan` strings with a few of tpkit's own; every other module names them through the constants below.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from ..layout import Piece, ShardLayout
from .errors import PlanError
from ..layout import HeadLayoutError, group_pieces, head_layout, head_spans
from .mha import MULTIHEAD_ATTENTION, MultiheadAttentionHeads
from .per_head import PER_HEAD, PerHead
from .modules import (as_linear, is_conv2d, is_embedding, is_linear, is_per_channel, is_plain_conv2d,
                      is_transposed_linear, keep_output_scale, kind, linear_dims)

COLWISE = "colwise"
COLWISE_REP = "colwise_rep"
VOCAB_PARALLEL = "vocab_parallel"
ROWWISE = "rowwise"
ROWWISE_REP = "rowwise_rep"
EMBEDDING_ROWWISE = "embedding_rowwise"
EMBEDDING_COLWISE = "embedding_colwise"
CHANNELWISE = "channelwise"
SEQUENCE_PARALLEL = "sequence_parallel"
REPLICATE = "replicate"
REPLICATED_WITH_GRAD_ALLREDUCE = "replicated_with_grad_allreduce"

Layouts = dict[str, ShardLayout]


def replicated_layouts(m: nn.Module, world: int, rank: int) -> Layouts:
    """Every parameter and persistent buffer of `m` (its own, not its children's), whole on every rank."""
    out = {n: ShardLayout.replicated(p.shape, world, rank) for n, p in m.named_parameters(recurse=False)}
    for n, b in m.named_buffers(recurse=False):
        if n not in m._non_persistent_buffers_set:
            out[n] = ShardLayout.replicated(b.shape, world, rank)
    return out


class Style:
    """A style that leaves the module whole (the base every other style refines)."""

    name = REPLICATE
    description = "every rank holds the whole module"
    collectives: tuple[str, ...] = ()
    container = False  # applies to container modules (HF plan entries tpkit's layers make unnecessary)

    def check(self, name: str, m: nn.Module, details: Mapping, world: int) -> None:
        """Raise PlanError if this style cannot be applied to `m` at this world size."""

    def layouts(self, m: nn.Module, details: Mapping, world: int, rank: int) -> Layouts:
        return replicated_layouts(m, world, rank)

    def build(self, m: nn.Module, layouts: Layouts, comm, sequence_parallel: bool = False) -> nn.Module | None:
        """This rank's replacement for `m`, or None when `m` stays as it is."""
        return None


class ContainerNoOp(Style):
    container = True

    def __init__(self, name: str):
        self.name = name
        self.description = f"HF container style {name!r}: tpkit's layers already do this communication"


class ReplicatedGradAllReduce(Style):
    name = REPLICATED_WITH_GRAD_ALLREDUCE
    description = ("every rank holds the whole module, applied to its own heads only (a per-head q/k norm): its "
                   "gradient is summed over the ranks")
    collectives = ("all_reduce (backward)",)


class SequenceParallelNorm(Style):
    name = SEQUENCE_PARALLEL
    description = ("a replicated per-token layer (norm) running on this rank's slice of the sequence; its gradient "
                   "is a partial sum (tpkit.nn.sync_sequence_parallel_grads before the step)")


# ---------------------------------------------------------------------------------------------- split features
def feature_pieces(details: Mapping, size: int, world: int, column: bool) -> tuple[Piece, ...]:
    """How the split feature dimension (`size` features) is cut, from the planner's details: whole heads for
    attention projections (KV heads replicated when fewer than ranks), packed projections piece by piece, the
    split rule otherwise."""
    if details.get("pair") == "attention":
        where = details.get("attention") or "attention"
        try:
            lay = head_layout(details["num_heads"], details["num_kv_heads"], world, where)
        except HeadLayoutError as exc:
            raise PlanError(f"{exc}; mark this attention block 'replicate' instead") from None
        hd, role = details["head_dim"], details.get("role")
        q = Piece(0, lay.num_heads * hd, head_spans(lay.q_heads, hd))
        if not column:
            return (q,)
        kv_size = lay.num_kv_heads * hd
        if role == "q":
            return (q,)
        if role in ("k", "v"):
            return (Piece(0, kv_size, head_spans(lay.kv_heads, hd)),)
        if role == "qkv":
            qw, kw = details["pieces"][0], details["pieces"][1]
            return (Piece(0, qw, q.spans), Piece(qw, kw, head_spans(lay.kv_heads, hd)),
                    Piece(qw + kw, kw, head_spans(lay.kv_heads, hd)))
        if role == "qkv_heads":  # GPT-NeoX: [heads, 3 x head_dim]
            return (Piece(0, size, head_spans(lay.q_heads, 3 * hd)),)
        if role == "qkv_groups":  # Falcon: [kv heads, group + 2, head_dim]
            return group_pieces(lay, hd, details["group"])
    pieces = details.get("pieces") if column else None
    out, offset = [], 0
    for p in pieces or [size]:
        out.append(Piece.split(offset, p, world))
        offset += p
    return tuple(out)


def _split_layout(shape: tuple, held_dim: int, pieces: tuple[Piece, ...], transposed: bool, world: int,
                  rank: int) -> ShardLayout:
    """A layout for a tensor held with `held_dim` split; a transposed (Conv1D) weight is stored the other way."""
    dim = (len(shape) - 1 - held_dim) if transposed else held_dim
    return ShardLayout(tuple(shape), world, rank, dim, pieces, transposed)


class _FeatureSplit(Style):
    """Linear / Conv1D / Conv2d(groups=1) layers split over output (`column`) or input features."""

    column = True
    uses_details = True  # attention heads and packed pieces; the *_rep and vocab styles use the plain split

    def check(self, name: str, m: nn.Module, details: Mapping, world: int) -> None:
        where = f"{name} ({kind(m)})"
        if not (is_linear(m) or is_plain_conv2d(m)):
            raise PlanError(f"{where}: style {self.name!r} needs a Linear, Conv1D or Conv2d (groups=1)")
        size = self._split_size(m)
        if size < world:
            raise PlanError(f"{where}: {size} features cannot be split over {world} ranks; use 'replicate' or a "
                            f"world size <= {size}")

    def _split_size(self, m: nn.Module) -> int:
        if is_conv2d(m):
            return m.out_channels if self.column else m.in_channels
        n_in, n_out = linear_dims(m)
        return n_out if self.column else n_in

    def layouts(self, m: nn.Module, details: Mapping, world: int, rank: int) -> Layouts:
        d = details if self.uses_details and not is_conv2d(m) else {}
        pieces = feature_pieces(d, self._split_size(m), world, self.column)
        transposed = is_transposed_linear(m)
        out = {"weight": _split_layout(tuple(m.weight.shape), 0 if self.column else 1, pieces, transposed, world,
                                       rank)}
        if getattr(m, "bias", None) is not None:
            out["bias"] = (ShardLayout(tuple(m.bias.shape), world, rank, 0, pieces) if self.column
                           else ShardLayout.replicated(m.bias.shape, world, rank))
        return out


class ColWise(_FeatureSplit):
    name = COLWISE
    description = ("split output features (attention: whole heads; packed projections: piece by piece); output "
                   "stays split for the row-wise layer that follows")
    gather = False

    def build(self, m: nn.Module, layouts: Layouts, comm, sequence_parallel: bool = False) -> nn.Module:
        from ..nn import ColumnParallelConv2d, ColumnParallelLinear

        if is_conv2d(m):
            return ColumnParallelConv2d.from_module(m, comm, gather_output=self.gather)
        lay = layouts["weight"]
        lin, sp = as_linear(m), _sp(sequence_parallel)
        if lay.is_plain_split() or self.gather:
            return ColumnParallelLinear.from_module(lin, comm, gather_output=self.gather, **sp)
        layer = ColumnParallelLinear.from_module(lin, comm, index=lay.index(), partition_sizes=lay.sizes(), **sp)
        replicas = lay.replicas()
        # Some rows (replicated KV heads) live on several ranks: every rank joins the gradient sum, including
        # one whose own rows are all single (KV heads 2 over 3 ranks: rank 0 holds head 0 alone).
        if any(max(lay.for_rank(r).replicas(), default=1) > 1 for r in range(lay.world_size)):
            _sum_replicated_row_grads(layer, lay.index(), lay.full_shape[lay.dim], comm)
            for p in (layer.weight, layer.bias):
                if p is not None:
                    p.partition_replicas = replicas  # type: ignore[attr-defined]
        return layer


class ColWiseRep(ColWise):
    name = COLWISE_REP
    description = "split output features, all-gather the output (e.g. an LM head for inference)"
    collectives = ("all_gather",)
    gather = True
    uses_details = False


class VocabParallel(ColWise):
    name = VOCAB_PARALLEL
    description = "LM head split over the vocabulary, logits stay split; use vocab_parallel_cross_entropy"
    uses_details = False


class RowWise(_FeatureSplit):
    name = ROWWISE
    description = "split input features; its input is a column-wise layer's split output; one all-reduce"
    collectives = ("all_reduce",)
    column = False
    input_is_parallel = True

    def build(self, m: nn.Module, layouts: Layouts, comm, sequence_parallel: bool = False) -> nn.Module:
        from ..nn import RowParallelConv2d, RowParallelLinear

        if is_conv2d(m):
            return RowParallelConv2d.from_module(m, comm, input_is_parallel=self.input_is_parallel)
        lay = layouts["weight"]
        lin, sp = as_linear(m), _sp(sequence_parallel)
        if lay.is_plain_split() or not self.input_is_parallel:
            return RowParallelLinear.from_module(lin, comm, input_is_parallel=self.input_is_parallel, **sp)
        return RowParallelLinear.from_module(lin, comm, index=lay.index(), partition_sizes=lay.sizes(), **sp)


class RowWiseRep(RowWise):
    name = ROWWISE_REP
    description = "split input features of a full (replicated) input, slicing it locally; one all-reduce"
    input_is_parallel = False
    uses_details = False


# ---------------------------------------------------------------------------------------------- other layers
class _EmbeddingSplit(Style):
    dim = 0

    def check(self, name: str, m: nn.Module, details: Mapping, world: int) -> None:
        from ..nn._layer import check_module
        from ..nn.embedding import UNSUPPORTED_EMBEDDING_OPTIONS

        where = f"{name} ({kind(m)})"
        if not is_embedding(m):
            raise PlanError(f"{where}: style {self.name!r} needs an nn.Embedding")
        n = m.weight.shape[self.dim]
        if n < world:
            raise PlanError(f"{where}: {n} rows/features cannot be split over {world} ranks")
        try:  # the layer's own rule for which embeddings it can shard
            check_module(f"{where}: {self.name}", m, nn.Embedding, UNSUPPORTED_EMBEDDING_OPTIONS)
        except (TypeError, ValueError) as exc:
            raise PlanError(f"{exc}; plan it 'replicate'") from None

    def layouts(self, m: nn.Module, details: Mapping, world: int, rank: int) -> Layouts:
        return {"weight": ShardLayout.split(tuple(m.weight.shape), self.dim, world, rank)}


class EmbeddingRowwise(_EmbeddingSplit):
    name = EMBEDDING_ROWWISE
    description = "embedding split over the vocabulary (VocabParallelEmbedding); one all-reduce"
    collectives = ("all_reduce",)

    def build(self, m: nn.Module, layouts: Layouts, comm, sequence_parallel: bool = False) -> nn.Module:
        from ..nn import VocabParallelEmbedding

        return keep_output_scale(m, VocabParallelEmbedding.from_module(m, comm))


class EmbeddingColwise(_EmbeddingSplit):
    name = EMBEDDING_COLWISE
    description = "embedding split over its features (ParallelEmbedding); one all-gather"
    collectives = ("all_gather",)
    dim = 1

    def build(self, m: nn.Module, layouts: Layouts, comm, sequence_parallel: bool = False) -> nn.Module:
        from ..nn import ParallelEmbedding

        return keep_output_scale(m, ParallelEmbedding.from_module(m, comm))


class ChannelWise(Style):
    name = CHANNELWISE
    description = "per-channel layer (BatchNorm) between a column and a row conv: holds this rank's channels"

    def check(self, name: str, m: nn.Module, details: Mapping, world: int) -> None:
        if not is_per_channel(m):
            raise PlanError(f"{name} ({kind(m)}): style 'channelwise' needs a BatchNorm")
        if m.num_features < world:
            raise PlanError(f"{name} ({kind(m)}): {m.num_features} channels cannot be split over {world} ranks")

    def layouts(self, m: nn.Module, details: Mapping, world: int, rank: int) -> Layouts:
        out = replicated_layouts(m, world, rank)
        for n in ("weight", "bias", "running_mean", "running_var"):
            if n in out:
                out[n] = ShardLayout.split(out[n].full_shape, 0, world, rank)
        return out

    def build(self, m: nn.Module, layouts: Layouts, comm, sequence_parallel: bool = False) -> nn.Module:
        """This rank's channels of a BatchNorm (weights, bias and running statistics), cut by `layouts`."""
        from ..nn import mark_tensor_parallel

        n = layouts["running_mean"] if "running_mean" in layouts else layouts["weight"]
        new = type(m)(n.local_shape[0], eps=m.eps, momentum=m.momentum, affine=m.affine,
                      track_running_stats=m.track_running_stats, device="meta")
        device = next((t.device for t in list(m.parameters()) + list(m.buffers())), None)
        if device is not None and device.type != "meta":
            new = new.to_empty(device=device)
        for pname in ("weight", "bias"):
            p = getattr(m, pname)
            if p is not None:
                q = nn.Parameter(layouts[pname].shard(p.detach()).clone(), requires_grad=p.requires_grad)
                setattr(new, pname, mark_tensor_parallel(q, 0, layouts[pname].sizes()))
        for bname in ("running_mean", "running_var"):
            b = getattr(m, bname)
            if b is not None:
                setattr(new, bname, layouts[bname].shard(b.detach()).clone())
        if m.num_batches_tracked is not None:
            new.num_batches_tracked = m.num_batches_tracked.detach().clone()
        new.train(m.training)
        return new


def _sp(on: bool) -> dict:
    """Sequence parallelism on the [batch, seq, hidden] activations of HF models: the dim before features."""
    return {"sequence_parallel": True, "sequence_dim": -2} if on else {}


def _sum_replicated_row_grads(layer: nn.Module, rows: tuple[int, ...], n_out: int, comm) -> None:
    """Rows held by several ranks (replicated KV heads) get, on each, only the gradient of that rank's query
    heads; the full gradient is their sum, so sum it over the ranks (scatter-add into the full shape, one
    all-reduce, pick the rows back) before any optimizer sees it."""
    from ..comm import traceable

    idx = torch.tensor(rows, dtype=torch.long)

    def hook(grad):
        full = grad.new_zeros((n_out,) + tuple(grad.shape[1:]))
        full.index_add_(0, idx.to(grad.device), grad)
        return traceable.all_reduce_(full, comm).index_select(0, idx.to(grad.device))  # `full` is ours

    for p in (layer.weight, layer.bias):
        if p is not None and p.requires_grad and p.device.type != "meta":
            p.register_hook(hook)


STYLES: dict[str, Style] = {s.name: s for s in (
    ColWise(), ColWiseRep(), VocabParallel(), RowWise(), RowWiseRep(), EmbeddingRowwise(), EmbeddingColwise(),
    ChannelWise(), SequenceParallelNorm(), Style(), ReplicatedGradAllReduce())}
STYLES[PER_HEAD] = PerHead()  # type: ignore[assignment]  # per_head.py, mha.py: same interface, kept with
STYLES[MULTIHEAD_ATTENTION] = MultiheadAttentionHeads()  # type: ignore[assignment]  # their concepts
CONTAINER_NO_OPS: dict[str, Style] = {n: ContainerNoOp(n) for n in ("gather", "all_reduce", "local", "ep_router",
                                                                    "moe_identity_expert")}
ALIASES = {
    "local_colwise": COLWISE, "packed_colwise": COLWISE, "colwise_gather_output": COLWISE_REP,
    "gather_output": COLWISE_REP, "local_rowwise": ROWWISE, "packed_rowwise": ROWWISE,
    "rowwise_split_input": ROWWISE_REP, "vocab": EMBEDDING_ROWWISE, "vocab_parallel_embedding": EMBEDDING_ROWWISE,
    "replicated": REPLICATE, "none": REPLICATE, "local_packed_rowwise": ROWWISE, "isolated": REPLICATE,
}
COLUMN_STYLES = frozenset((COLWISE, COLWISE_REP, VOCAB_PARALLEL))
ROW_STYLES = frozenset((ROWWISE, ROWWISE_REP))
VOCAB_STYLES = frozenset((EMBEDDING_ROWWISE, COLWISE_REP, VOCAB_PARALLEL))  # tied weights split over the vocabulary


def style(name: str) -> Style:
    """The style object of a canonical style name."""
    return STYLES.get(name) or CONTAINER_NO_OPS[name]


def canonical_style(name: str, where: str = "plan") -> str:
    """The canonical name of a style string (case-insensitive; aliases accepted)."""
    if not isinstance(name, str):
        raise PlanError(f"{where}: style must be a string, got {name!r}")
    s = name.strip().lower()
    s = ALIASES.get(s, s)
    if s in STYLES or s in CONTAINER_NO_OPS:
        return s
    raise PlanError(f"{where}: unknown style {name!r}; valid styles: {', '.join(sorted(STYLES))} "
                    f"(aliases: {', '.join(sorted(ALIASES))})")


def for_module(name: str, m: nn.Module) -> str:
    """The style `name` means on module `m`. HF plans write 'rowwise' / 'colwise' on embeddings too (PyTorch's
    styles shard an embedding's weight by rows, the vocabulary, or by columns, its features): on an embedding
    they are the embedding styles, so every later check (ties, sizes, dataflow) sees one vocabulary."""
    if is_embedding(m) and name in (ROWWISE, COLWISE):
        return EMBEDDING_ROWWISE if name == ROWWISE else EMBEDDING_COLWISE
    return name


def module_layouts(m: nn.Module, style_name: str, details: Mapping, world: int, rank: int) -> Layouts:
    """Every tensor `m` holds directly, as this rank holds it under `style_name` (all whole at world size 1)."""
    if world == 1:
        return replicated_layouts(m, world, rank)
    return style(for_module(style_name, m)).layouts(m, details, world, rank)

