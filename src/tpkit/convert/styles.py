"""The plan styles: one small class per style, every one a `Style`; the core ones live here, the rest in the
architecture family that adds them, and `registry.STYLES` holds them all.

A style says four things about a module (as PyTorch's `tensor/parallel/style.py` keeps one class per style):
which module types it applies to and which sizes it needs (`check`), which part of each of the module's
tensors a rank holds (`layouts`, one `ShardLayout` per parameter and persistent buffer), which `tpkit.nn`
layer replaces the module (`build`, made from those layouts, so the shard built and the shard described are one
fact), and what its neighbours in the dataflow must be (`check_dataflow`, read through `split_output` /
`split_input` of the styles around it). `collectives` names the communication its layer does in the forward.
Style names are Hugging Face's `tp_plan` strings with a few of tpkit's own; every other module names them
through the constants below.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from ..layout import HeadLayoutError, Piece, ShardLayout, group_pieces, head_columns, head_spans
from ..nn.grad_sums import rows_sum, sum_grads
from .errors import PlanError
from .modules import (as_linear, is_conv2d, is_embedding, is_linear, is_per_channel, is_plain_conv2d,
                      is_transposed_linear, keep_output_scale, kind, linear_dims)
from .roles import Role

COLWISE = "colwise"
COLWISE_REP = "colwise_rep"
VOCAB_PARALLEL = "vocab_parallel"
ROWWISE = "rowwise"
ROWWISE_REP = "rowwise_rep"
EMBEDDING_ROWWISE = "embedding_rowwise"
EMBEDDING_COLWISE = "embedding_colwise"
CHANNELWISE = "channelwise"
REPLICATE = "replicate"
#: Ends the reason of a layer replicated because it is small (norms, position tables, small heads): by design, not
#: a limit hit, so `Plan.kept_whole()` leaves it out.
SMALL = " (small; replicated)"
#: Ends the reason of a layer no family could pair, split on its own with a whole output (`families/lone_layers.py`):
#: `Plan.split_alone()` lists them, as it costs an all-gather per call that a paired split would not.
ALONE = "; split alone by its output features, the output all-gathered on every call"
SEQUENCE_PARALLEL = "sequence_parallel"  # also a conversion option: parallelize(..., sequence_parallel=True)

Layouts = dict[str, ShardLayout]
Lookup = Callable[[str], "Style"]  # a module name -> the Style object it is planned with


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
    container = False     # applies to container modules (HF plan entries tpkit's layers make unnecessary)
    region = False        # a container style that acts on its module as one region (kept in the plan's record)
    owns_module = False   # holds parameters itself although a child is planned on its own
    split_output = False  # its output stays split over features, for layers that take a split input
    split_input = False   # it takes a feature-split input
    splits = False        # it splits some tensor (False: every rank holds the module whole)
    builds_quantized = False  # its `build` takes `quant_method=` (a linear layer a checkpoint stores quantized)

    def check(self, name: str, m: nn.Module, role: Role | None, world: int) -> None:
        """Raise PlanError if this style cannot be applied to `m` at this world size."""

    def layouts(self, m: nn.Module, role: Role | None, world: int, rank: int) -> Layouts:
        return replicated_layouts(m, world, rank)

    def build(self, m: nn.Module, layouts: Layouts, comm, sequence_parallel: bool = False) -> nn.Module | None:
        """This rank's replacement for `m`, or None when `m` stays as it is. A style that `builds_quantized` also
        takes `quant_method=`: the layer is built holding the checkpoint's stored tensors (`tpkit.nn.quantized`)."""
        return None

    def check_dataflow(self, name: str, planned: Any, lookup: Lookup) -> None:
        """Raise PlanError if the traced dataflow around `name` does not fit this style (`planned`: the
        `family.Planned` being validated; `lookup`: the style object of any module)."""


class ContainerNoOp(Style):
    container = True

    def __init__(self, name: str):
        self.name = name
        self.description = f"HF container style {name!r}: tpkit's layers already do this communication"


# ---------------------------------------------------------------------------------------------- split features
def feature_pieces(details: Role | None, size: int, world: int, column: bool) -> tuple[Piece, ...]:
    """How the split feature dimension (`size` features) is cut, from the module's role: whole heads for
    attention projections (KV heads replicated when fewer than ranks; a gate on the attention output follows the
    query heads, one value per head for a per-head gate), packed projections piece by piece, the split rule
    otherwise."""
    if details is not None and details.is_attention:
        try:
            lay = details.heads(world)
        except HeadLayoutError as exc:
            raise PlanError(f"{exc}; mark this attention block 'replicate' instead") from None
        hd, role = details.head_dim, details.role
        q = Piece(0, lay.num_heads * hd, head_spans(lay.q_heads, hd))
        if not column:
            return (q,)
        kv_size = lay.num_kv_heads * hd
        if role in ("q", "gate"):
            return (q,)
        if role == "head_gate":
            return (head_columns(lay),)
        if role in ("k", "v"):
            return (Piece(0, kv_size, head_spans(lay.kv_heads, hd)),)
        if role == "qkv":
            qw, kw = details.pieces[0], details.pieces[1]
            return (Piece(0, qw, q.spans), Piece(qw, kw, head_spans(lay.kv_heads, hd)),
                    Piece(qw + kw, kw, head_spans(lay.kv_heads, hd)))
        if role == "qkv_heads":  # GPT-NeoX: [heads, 3 x head_dim]
            return (Piece(0, size, head_spans(lay.q_heads, 3 * hd)),)
        if role == "qkv_groups":  # Falcon: [kv heads, group + 2, head_dim]
            return group_pieces(lay, hd, details.group)
    pieces = details.pieces if column and details is not None else None
    unit = (details.unit if details is not None else None) or 1
    out, offset = [], 0
    for p in pieces or [size]:
        out.append(Piece.split(offset, p, world, unit if p % unit == 0 else 1))
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

    splits = True

    def check(self, name: str, m: nn.Module, role: Role | None, world: int) -> None:
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

    def layouts(self, m: nn.Module, role: Role | None, world: int, rank: int) -> Layouts:
        d = role if self.uses_details and not is_conv2d(m) else None
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
    split_output = True
    description = ("split output features (attention: whole heads; packed projections: piece by piece); output "
                   "stays split for the row-wise layer that follows")
    gather = False
    builds_quantized = True

    def build(self, m: nn.Module, layouts: Layouts, comm, sequence_parallel: bool = False,
              quant_method=None) -> nn.Module:
        from ..nn import ColumnParallelConv2d, ColumnParallelLinear

        if is_conv2d(m):
            return ColumnParallelConv2d.from_module(m, comm, gather_output=self.gather)
        lay = layouts["weight"]
        lin, sp = as_linear(m), _sp(sequence_parallel)
        if quant_method is not None:
            sp.update(quant_method=quant_method, weight_layout=lay)
        if lay.is_plain_split() or self.gather:
            return ColumnParallelLinear.from_module(lin, comm, gather_output=self.gather, **sp)
        layer = ColumnParallelLinear.from_module(lin, comm, index=lay.index(), partition_sizes=lay.sizes(), **sp)
        # Some rows (replicated KV heads) live on several ranks: every rank joins the gradient sum, including
        # one whose own rows are all single (KV heads 2 over 3 ranks: rank 0 holds head 0 alone). How many ranks
        # hold each row is the layout's fact (`replicas()`), which the model's record keeps by name.
        rows = rows_sum(lay)
        if rows is not None:
            sum_grads(layer, {n: rows for n, p in layer.named_parameters(recurse=False)}, comm)
        return layer

    def check_dataflow(self, name: str, planned: Any, lookup: Lookup) -> None:
        """A split output must reach only layers that take a split input, and every column feeding the same
        row-wise layer must be split with it."""
        a = planned.analysis
        t = a.trace
        if self.name != COLWISE or t is None or planned.world_size == 1 or name not in t.calls:
            return
        users = t.consumers.get(name, set())
        bad = sorted(u for u in users if not lookup(u).split_input)
        if name in t.escaped:
            bad.append("<model output>")
        if bad or not users:
            raise PlanError(f"conflicting entries: {name} is 'colwise' (its output stays split) but its output "
                            f"feeds {bad or 'no layer'}, which take(s) the whole vector; make those 'rowwise' or "
                            f"{name} 'replicate'/'colwise_rep'")
        shared = a.structures.get(name)
        row = a.structures.get(shared.row) if shared is not None and shared.row else None
        for other in row.columns if row is not None else ():
            if planned.style_of(other) != COLWISE:
                raise PlanError(f"conflicting entries: {name} is 'colwise' but {other}, which feeds the same "
                                f"row-wise layer {shared.row}, is {planned.style_of(other)!r}")


class ColWiseRep(ColWise):
    name = COLWISE_REP
    split_output = False
    description = "split output features, all-gather the output (e.g. an LM head for inference)"
    collectives = ("all_gather",)
    gather = True
    uses_details = False


class VocabParallel(ColWise):
    name = VOCAB_PARALLEL
    split_output = False  # split logits leave the model (for vocab_parallel_cross_entropy)
    description = "LM head split over the vocabulary, logits stay split; use vocab_parallel_cross_entropy"
    uses_details = False


class RowWise(_FeatureSplit):
    name = ROWWISE
    description = "split input features; its input is a column-wise layer's split output; one all-reduce"
    collectives = ("all_reduce",)
    column = False
    input_is_parallel = True
    split_input = True
    builds_quantized = True

    def build(self, m: nn.Module, layouts: Layouts, comm, sequence_parallel: bool = False,
              quant_method=None) -> nn.Module:
        from ..nn import RowParallelConv2d, RowParallelLinear

        if is_conv2d(m):
            return RowParallelConv2d.from_module(m, comm, input_is_parallel=self.input_is_parallel)
        lay = layouts["weight"]
        lin, sp = as_linear(m), _sp(sequence_parallel)
        if quant_method is not None:
            sp.update(quant_method=quant_method, weight_layout=lay)
        if lay.is_plain_split() or not self.input_is_parallel:
            return RowParallelLinear.from_module(lin, comm, input_is_parallel=self.input_is_parallel, **sp)
        return RowParallelLinear.from_module(lin, comm, index=lay.index(), partition_sizes=lay.sizes(), **sp)

    def check_dataflow(self, name: str, planned: Any, lookup: Lookup) -> None:
        """Its input must come from layers whose output stays split."""
        t = planned.analysis.trace
        if not self.input_is_parallel or t is None or planned.world_size == 1 or name not in t.calls:
            return
        tag = t.first(name).input_tag
        srcs = sorted(tag.sources) if tag is not None else []
        bad = [x for x in srcs if not lookup(x).split_output]
        if bad or not srcs:
            raise PlanError(f"conflicting entries: {name} is 'rowwise' (it takes a split input) but its input comes "
                            f"from {bad or 'no layer'}, which give(s) the whole vector; use 'rowwise_rep' or make "
                            f"them 'colwise'")


class RowWiseRep(RowWise):
    name = ROWWISE_REP
    description = "split input features of a full (replicated) input, slicing it locally; one all-reduce"
    input_is_parallel = False
    uses_details = False
    split_input = False


# ---------------------------------------------------------------------------------------------- other layers
class _EmbeddingSplit(Style):
    dim = 0
    splits = True

    def check(self, name: str, m: nn.Module, role: Role | None, world: int) -> None:
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

    def layouts(self, m: nn.Module, role: Role | None, world: int, rank: int) -> Layouts:
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
    split_input = split_output = splits = True

    def check(self, name: str, m: nn.Module, role: Role | None, world: int) -> None:
        if not is_per_channel(m):
            raise PlanError(f"{name} ({kind(m)}): style 'channelwise' needs a BatchNorm")
        if m.num_features < world:
            raise PlanError(f"{name} ({kind(m)}): {m.num_features} channels cannot be split over {world} ranks")

    def layouts(self, m: nn.Module, role: Role | None, world: int, rank: int) -> Layouts:
        out = replicated_layouts(m, world, rank)
        for n in ("weight", "bias", "running_mean", "running_var"):
            if n in out:
                out[n] = ShardLayout.split(out[n].full_shape, 0, world, rank)
        return out

    def build(self, m: nn.Module, layouts: Layouts, comm, sequence_parallel: bool = False) -> nn.Module:
        """This rank's channels of a BatchNorm (weights, bias and running statistics), cut by `layouts`."""
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
                setattr(new, pname, q)
        for bname in ("running_mean", "running_var"):
            b = getattr(m, bname)
            if b is not None:
                setattr(new, bname, layouts[bname].shard(b.detach()).clone())
        if m.num_batches_tracked is not None:
            new.num_batches_tracked = m.num_batches_tracked.detach().clone()
        new.train(m.training)
        return new

    def check_dataflow(self, name: str, planned: Any, lookup: Lookup) -> None:
        t = planned.analysis.trace
        if t is None or planned.world_size == 1 or name not in t.carried_by:
            return
        bad = [x for x in t.carried_by[name] if planned.style_of(x) != COLWISE]
        if bad:
            raise PlanError(f"conflicting entries: {name} is 'channelwise' but its input comes from {bad}, which "
                            f"is not 'colwise'")


def _sp(on: bool) -> dict:
    """Sequence parallelism on the [batch, seq, hidden] activations of HF models: the dim before features."""
    return {"sequence_parallel": True, "sequence_dim": -2} if on else {}


CORE_STYLES: tuple[Style, ...] = (ColWise(), ColWiseRep(), VocabParallel(), RowWise(), RowWiseRep(), EmbeddingRowwise(),
                                  EmbeddingColwise(), ChannelWise(), Style())
CONTAINER_NO_OPS: tuple[Style, ...] = tuple(ContainerNoOp(n) for n in ("gather", "all_reduce", "local", "ep_router",
                                                                       "moe_identity_expert"))
ALIASES = {
    "local_colwise": COLWISE, "packed_colwise": COLWISE, "colwise_gather_output": COLWISE_REP,
    "gather_output": COLWISE_REP, "local_rowwise": ROWWISE, "packed_rowwise": ROWWISE,
    "rowwise_split_input": ROWWISE_REP, "vocab": EMBEDDING_ROWWISE, "vocab_parallel_embedding": EMBEDDING_ROWWISE,
    "replicated": REPLICATE, "none": REPLICATE, "local_packed_rowwise": ROWWISE, "isolated": REPLICATE,
}
VOCAB_STYLES = frozenset((EMBEDDING_ROWWISE, COLWISE_REP, VOCAB_PARALLEL))  # tied weights split over the vocabulary
