"""Dataflow trace: which layer's output reaches which layer's input, and through what kind of ops.

The planner may only pair a column-parallel layer with a row-parallel one when the tensor between them is
touched by nothing but per-feature (elementwise) work; otherwise the shards would meet an op that needs the
whole feature vector. Parameter names cannot tell that, so we run one forward (on meta tensors or a tiny real
input) and watch it: forward hooks tag the output of every layer that owns parameters, and a
`TorchFunctionMode` carries the tags through every torch op in between, noting whether each op was
elementwise, a split of the last dimension (packed projections), or something that mixes features.

The ops the tracer tells apart are named in `ops.py`. Parameters that no layer owns (an attention module's own
sinks, per-head biases) are followed beside the tags (`loose.py`), and the pieces of packed projections are
gathered in `pieces.py`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..modules import is_conv2d, is_per_channel, is_scalar_elementwise
from .flat import flatten
from .heads import cut_size
from .loose import LooseParams
from .ops import CUTS, ELEMENTWISE, JOINS, LAYOUT, METADATA, RESHAPES, SHAPE_OF, SPLITS
from .pieces import Pieces, axes
from .state import output_tensors, popping, run_once


@dataclasses.dataclass(frozen=True)
class Tag:
    """What a tensor is made of: the nearest parameterised layers upstream (`sources`), whether only
    per-feature ops lay between (`clean`), per-channel layers passed on the way (`carried`), the first op
    that mixed features (`broken_by`), the last-dim sizes seen on reshapes (`reshaped_to`, head sizes), and
    the sources whose features were mixed before any reshape (`unproven`: an interleaved rotary or a custom
    packing over the whole projection, so its heads are not the contiguous blocks a split would give)."""

    sources: frozenset
    clean: bool = True
    carried: frozenset = frozenset()
    broken_by: str | None = None
    reshaped_to: frozenset = frozenset()
    unproven: frozenset = frozenset()
    headed: bool = False  # a reshape added axes (to heads; one head of the projection's width included)
    # the last two and three sizes of reshapes that split the features ([heads, 3, hd], [3, heads, hd], [heads + 2,
    # hd]), when they hold exactly the features: which layout a packed projection has
    blocks: frozenset = frozenset()
    cut: frozenset = frozenset()  # sizes of axes (not the last) a CUTS op changed once the tensor had heads
    # plain slices `[..., a:b, :]` taken once the tensor had heads, along the axis before the last: (that axis'
    # size, a, b), as Falcon's query `[..., :-2, :]` of [heads + 2, hd] (which part of a packed block is the query)
    head_slices: frozenset = frozenset()
    # the feature widths of the tensors on which the ops that made `unproven` ran: one head's width (GPT-BigCode's
    # single key head, a piece of hd features never reshaped) is mixed within that head only
    mixed_at: frozenset = frozenset()
    # the sources that met another tagged tensor in an op that is neither elementwise nor a join: q, k and v meet
    # in the scores and in probs @ v; a gate (`trace/attention.py`) meets the heads by elementwise ops only
    attended: frozenset = frozenset()
    # the sources of tensors a CUTS op ran on once they had heads (`cut` only sees the ops that change a size; a flip
    # or roll of the heads changes none): a gate among them no longer provably lines up with the query heads
    headed_cuts: frozenset = frozenset()

    def merge(self, other: "Tag") -> "Tag":
        return Tag(self.sources | other.sources, self.clean and other.clean, self.carried | other.carried,
                   self.broken_by or other.broken_by, self.reshaped_to | other.reshaped_to,
                   self.unproven | other.unproven, self.headed or other.headed, self.blocks | other.blocks,
                   self.cut | other.cut, self.head_slices | other.head_slices, self.mixed_at | other.mixed_at,
                   self.attended | other.attended, self.headed_cuts | other.headed_cuts)


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a parameterised layer in the traced forward."""

    name: str
    order: int
    input_tag: Tag | None
    input_id: int | None
    input_shape: tuple | None
    output_shape: tuple | None


@dataclasses.dataclass(frozen=True)
class Trace:
    """The result: per layer its calls, its consumers, packed splits of its output, and which layers'
    outputs leave the model (LM heads, classifiers)."""

    calls: dict[str, list[Call]]
    consumers: dict[str, set]
    pieces: dict[str, tuple]
    escaped: set
    carried_by: dict[str, frozenset]
    broken: set = dataclasses.field(default_factory=set)  # layers whose output slices do not tile its features
    head_local: dict = dataclasses.field(default_factory=dict)  # per-head layers (q/k norms) -> their sources
    # every module -> {id of a tensor argument of its first call: its position (int) or keyword (str)}
    module_inputs: dict = dataclasses.field(default_factory=dict)
    # layers whose parameters an op outside their own forward read (layer -> that op): a fused fast path or a
    # parent that does `F.linear(x, child.weight)`; a shard there would meet code that expects the whole tensor
    read_directly: dict = dataclasses.field(default_factory=dict)
    readers: dict = dataclasses.field(default_factory=dict)  # see read_directly: read by that MultiheadAttention
    # every module -> {position or keyword: (shape, id)} of the float tensor arguments of its first call that no
    # parameterised layer made (masks, ALiBi biases built from the mask)
    plain_args: dict = dataclasses.field(default_factory=dict)
    inputs: Any = None  # the example inputs the trace ran (the dry run runs them again)
    meetings: tuple = ()  # every `Meeting` of a loose parameter with a tagged tensor, in op order
    fed: frozenset = frozenset()  # loose parameters that reached a layer's input or the output untagged
    # every reshape that added an axis (`heads.cut_size`): (the modules running, outermost first; its last size)
    head_cuts: tuple = ()

    def first(self, name: str) -> Call | None:
        calls = self.calls.get(name)
        return calls[0] if calls else None


def _feature_dim(ref: torch.Tensor, producer_is_conv: bool) -> int:
    return 1 if producer_is_conv and ref.dim() >= 2 else ref.dim() - 1


class _Tracer(TorchFunctionMode):
    def __init__(self, conv_layers: set):
        super().__init__()
        self.tags: dict[int, tuple[torch.Tensor, Tag]] = {}
        self.depth = 0
        self.conv_layers = conv_layers
        self.packed = Pieces()  # packed projections: one layer's output cut into pieces (`pieces.py`)
        self._last_key: Any = None  # the key of the op just run when it was `__getitem__`
        self.owners: dict[int, tuple[torch.Tensor, str]] = {}  # id(parameter) -> (it, the layer that owns it)
        self.read_directly: dict[str, str] = {}
        self.readers: dict[str, str] = {}  # layer read directly -> the MultiheadAttention whose forward read it
        self.inside: list[str] = []  # the MultiheadAttention modules whose forward is running
        self.loose = LooseParams()  # parameters no layer owns, followed apart from the tags
        self.running: list[str] = []  # the modules whose forward is running, outermost first
        self.head_cuts: list[tuple[tuple[str, ...], int]] = []

    def tag_of(self, t: Any) -> Tag | None:
        if isinstance(t, torch.Tensor):
            entry = self.tags.get(id(t))
            if entry is not None and entry[0] is t:
                return entry[1]
        return None

    def set_tag(self, out: Any, tag: Tag) -> None:
        for t in flatten(out):
            if isinstance(t, torch.Tensor):
                self.tags[id(t)] = (t, tag)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._last_key = args[1] if getattr(func, "__name__", "") == "__getitem__" and len(args) > 1 else None
        if self.running and (size := cut_size(func, args, out)) is not None:
            self.head_cuts.append((tuple(self.running), size))
        if self.depth:
            return out
        name = getattr(func, "__name__", str(func))
        flat = flatten((args, kwargs))
        if name not in METADATA or isinstance(out, torch.Tensor):  # `.T` is a `__get__` too, `.shape` is not
            self._note_direct_reads(name, flat)
        if name in METADATA:
            return out
        if name in SHAPE_OF:  # `x.view_as(y)`: y gives a shape, none of its values
            flat = flat[:1]
        tagged = [(a, self.tag_of(a)) for a in flat]
        tags = [tg for _, tg in tagged if tg is not None]
        loose = [(a, n) for a in flat if (n := self.loose.names(a)) is not None]
        if not tags:
            if loose:
                self.loose.follow(name, loose, flat, out)
            return out
        if loose:
            self.loose.meet(name, loose, tagged, args, kwargs)
        tag = tags[0]
        for other in tags[1:]:
            tag = tag.merge(other)
        ref = next(a for a, tg in tagged if tg is not None)
        piece = self.packed.stacked_piece(self._last_key, ref, out) if name == "__getitem__" else None
        if piece is not None:
            self.set_tag(out, piece)
            return out
        is_conv = bool(tag.sources & self.conv_layers)
        fdim = _feature_dim(ref, is_conv)
        clean = tag.clean and self._per_feature(name, ref, flat, out, fdim, tag)
        reshaped, blocks, head_slices = tag.reshaped_to, tag.blocks, tag.head_slices
        if name in RESHAPES and isinstance(out, torch.Tensor) and out.dim() and ref.dim():
            if out.shape[-1] != ref.shape[-1]:
                reshaped = reshaped | {int(out.shape[-1])}
                blocks = blocks | {tuple(int(d) for d in out.shape[-n:]) for n in (2, 3)
                                   if out.dim() >= n and out.shape[-n:].numel() == ref.shape[-1]}
                self.packed.note_stacked(ref, out, tag, fdim)
        if name == "__getitem__" and tag.headed:
            head_slices = head_slices | self._head_slice(ref)
        keeps = (name in LAYOUT or (name in RESHAPES and fdim == ref.dim() - 1)) and isinstance(out, torch.Tensor) \
            and out.dim() and out.shape[-1] == ref.shape[-1]
        grows = isinstance(out, torch.Tensor) and out.dim() > ref.dim()
        # `unsqueeze(-1)` is the view to [..., features, 1]: heads of one feature (a per-head scalar gate)
        headed = tag.headed or bool(reshaped) or (name in RESHAPES and grows) or (
            name == "unsqueeze" and grows and out.shape[:-1] == ref.shape and out.shape[-1] == 1)
        mixes = not clean and not headed and not keeps
        unproven = tag.unproven | (tag.sources if mixes else frozenset())
        mixed_at = tag.mixed_at | ({int(ref.shape[fdim])} if mixes and ref.dim() else frozenset())
        cuts = tag.headed and name in CUTS
        cut = tag.cut | (self._cut(ref, out) if cuts else frozenset())
        attends = len(tags) > 1 and name not in ELEMENTWISE and name not in JOINS
        new = Tag(tag.sources, clean, tag.carried, tag.broken_by or (None if clean else name), reshaped, unproven,
                  headed, blocks, cut, head_slices, mixed_at, tag.attended | (tag.sources if attends else frozenset()),
                  tag.headed_cuts | (tag.sources if cuts else frozenset()))
        self.set_tag(out, new)
        return out

    def _head_slice(self, ref) -> frozenset:
        """A plain slice along the axis before the last of a tensor with heads: {(that axis' size, start, stop)}."""
        key = axes(self._last_key, ref.dim())
        if key is None or ref.dim() < 2 or not isinstance(key[-2], slice) or key[-2].step not in (None, 1) \
                or any(k != slice(None) for k in key[:-2] + key[-1:]):
            return frozenset()
        start, stop, _ = key[-2].indices(int(ref.shape[-2]))
        return frozenset({(int(ref.shape[-2]), start, stop)})

    @staticmethod
    def _cut(ref: torch.Tensor, out: Any) -> frozenset:
        """Sizes of the axes (all but the last) on which an output of a cut / join differs from its input."""
        sizes = set()
        for o in flatten(out):
            if isinstance(o, torch.Tensor) and o.dim() == ref.dim():
                sizes |= {int(s) for i in range(ref.dim() - 1) if o.shape[i] != ref.shape[i]
                          for s in (ref.shape[i], o.shape[i])}
        return frozenset(sizes)

    def _note_direct_reads(self, name: str, flat: list) -> None:
        """An op outside every layer's forward that takes a layer's parameter reads it directly."""
        for a in flat:
            owner = self.owners.get(id(a)) if isinstance(a, torch.Tensor) else None
            if owner is not None and owner[0] is a and owner[1] not in self.read_directly:
                self.read_directly[owner[1]] = name
                if self.inside:
                    self.readers[owner[1]] = self.inside[-1]

    def _per_feature(self, name, ref, flat, out, fdim, tag) -> bool:
        if name == "__getitem__":
            parts = self._last_key if isinstance(self._last_key, tuple) else (self._last_key,)
            if any(p is None for p in parts):  # only new leading axes (`repeat_kv`'s `x[:, :, None]`): features kept
                return isinstance(out, torch.Tensor) and fdim == ref.dim() - 1 and parts[-1] is not None and all(
                    p is None or p is Ellipsis or (isinstance(p, slice) and p == slice(None)) for p in parts)
            return self.packed.slice(self._last_key, ref, out, fdim, tag)
        if name in SPLITS:
            return self.packed.split(ref, out, fdim, tag)
        if name in RESHAPES:
            # Flattening leading dims keeps every feature in place.
            return isinstance(out, torch.Tensor) and out.dim() >= 1 and fdim == ref.dim() - 1 \
                and out.shape[-1] == ref.shape[-1]
        if name == "unsqueeze":  # a new leading axis (GPT-BigCode's `c_attn(x).unsqueeze(1)`) keeps them too
            dims = [a for a in flat if isinstance(a, int) and not isinstance(a, bool)]
            return isinstance(out, torch.Tensor) and len(dims) == 1 and fdim == ref.dim() - 1 \
                and dims[0] % out.dim() < out.dim() - 1
        if name in JOINS:  # along a leading axis (a KV cache's sequence), with nothing but tagged or empty
            # tensors: every feature stays in place
            dims = [a for a in flat if isinstance(a, int) and not isinstance(a, bool)]
            return isinstance(out, torch.Tensor) and fdim == ref.dim() - 1 and out.shape[-1] == ref.shape[-1] \
                and (dims[0] if dims else 0) % out.dim() < out.dim() - 1 and all(
                    self.tag_of(a) is not None or a.numel() == 0 for a in flat if isinstance(a, torch.Tensor))
        if name not in ELEMENTWISE:
            return False
        for a in flat:
            if isinstance(a, torch.Tensor) and self.tag_of(a) is None and a.numel() > 1:
                index = fdim - (ref.dim() - a.dim())
                if index >= 0 and a.shape[index] != 1:
                    return False  # an untagged operand varies along the features
        return True

def parameterised_leaves(modules: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """Of a model's `modules` (by name), those that own parameters directly and have no parameterised children: the
    layers we plan."""
    out = {}
    for name, m in modules.items():
        if any(True for _ in m.parameters(recurse=False)) and not any(
                any(True for _ in c.parameters()) for c in m.children()):
            out[name] = m
    return out


def first_tensor(args, kwargs) -> torch.Tensor | None:
    for a in flatten((args, kwargs)):
        if isinstance(a, torch.Tensor):
            return a
    return None


def is_head_local(mod, x, tag) -> bool:
    """A layer applied to each head on its own (Qwen3's q_norm / k_norm): its input was reshaped to heads
    of size D on the way from its sources, and every parameter it owns is one vector of D."""
    if tag is None or x is None or not x.dim() or int(x.shape[-1]) not in tag.reshaped_to:
        return False
    d = int(x.shape[-1])
    return all(tuple(p.shape) == (d,) for p in mod.parameters(recurse=False))


def _every_module(model: nn.Module, tracer: _Tracer, handles: list) -> tuple[dict, dict]:
    """Hooks on every module (appended to `handles`): the running modules (`tracer.running`, and the
    MultiheadAttention ones in `tracer.inside`), and each module's first call's tensor arguments, returned as
    `Trace.module_inputs` and `Trace.plain_args` (filled as the forward runs)."""
    module_inputs: dict[str, dict[int, int | str]] = {}
    plain_args: dict[str, dict] = {}
    for name, module in model.named_modules():
        if type(module) is nn.MultiheadAttention:  # reads its out_proj's weight itself (see families/mha.py)
            handles.append(module.register_forward_pre_hook(lambda *a, name=name: tracer.inside.append(name)))
            handles.append(module.register_forward_hook(popping(tracer.inside), always_call=True))

        def record(mod, args, kwargs, name=name):
            tracer.running.append(name)
            if name not in module_inputs:
                where = list(enumerate(args)) + list(kwargs.items())
                module_inputs[name] = {id(v): at for at, v in reversed(where) if isinstance(v, torch.Tensor)}
                plain_args[name] = {at: (tuple(v.shape), id(v)) for at, v in where if isinstance(v, torch.Tensor)
                                    and v.is_floating_point() and tracer.tag_of(v) is None}
        handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
        handles.append(module.register_forward_hook(popping(tracer.running), always_call=True))
    return module_inputs, plain_args


def trace(model: nn.Module, example_inputs: Any, leaves: Mapping[str, nn.Module] | None = None) -> Trace:
    """Run `model(*example_inputs)` (`**example_inputs` for a mapping, `model(x)` for one tensor) once and
    record its dataflow. `leaves`: the model's `parameterised_leaves` when the caller has them."""
    leaves = parameterised_leaves(dict(model.named_modules())) if leaves is None else leaves
    conv_layers = {n for n, m in leaves.items() if is_conv2d(m)}
    tracer = _Tracer(conv_layers)
    tracer.owners = {id(p): (p, n) for n, m in leaves.items() for p in m.parameters(recurse=False)}
    tracer.loose = LooseParams({id(p): (p, n) for n, p in model.named_parameters() if id(p) not in tracer.owners})
    calls: dict[str, list[Call]] = {}
    consumers: dict[str, set] = {}
    carried_by: dict[str, frozenset] = {}
    counter = [0]
    handles = []
    head_local: dict[str, frozenset] = {}

    for name, module in leaves.items():
        # per-channel layers (BatchNorm) and activations with scalar parameters pass a shard through
        per_channel = is_per_channel(module) or is_scalar_elementwise(module)

        def pre(mod, args, kwargs, name=name, per_channel=per_channel):
            x = first_tensor(args, kwargs)
            tracer.loose.feed(flatten((args, kwargs)))
            tag = tracer.tag_of(x)
            counter[0] += 1
            calls.setdefault(name, []).append(Call(name, counter[0], tag, id(x) if x is not None else None,
                                                  tuple(x.shape) if x is not None else None, None))
            if is_head_local(mod, x, tag) and not per_channel:
                head_local[name] = tag.sources
            elif tag is not None and not per_channel:
                for src in tag.sources:
                    consumers.setdefault(src, set()).add(name)
            tracer.depth += 1

        def post(mod, args, kwargs, out, name=name, per_channel=per_channel):
            tracer.depth -= 1
            y = first_tensor((out,), {})
            call = calls[name][-1] = dataclasses.replace(calls[name][-1],
                                                         output_shape=tuple(y.shape) if y is not None else None)
            if name in head_local and call.input_tag is not None and call.output_shape == call.input_shape:
                t = call.input_tag  # per head: the heads' tags flow through, marked as carried
                tracer.set_tag(out, dataclasses.replace(t, clean=False, carried=t.carried | {name},
                                                        broken_by=t.broken_by or name))
            elif per_channel and call.input_tag is not None:
                # A per-channel layer passes its input's shards straight through; remember it rides along.
                t = call.input_tag
                carried_by[name] = t.sources
                tracer.set_tag(out, dataclasses.replace(t, carried=t.carried | {name}))
            else:
                tracer.set_tag(out, Tag(frozenset({name})))

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    module_inputs, plain_args = _every_module(model, tracer, handles)
    try:
        out = run_once(model, example_inputs, tracer)
    finally:
        for h in handles:
            h.remove()
    pieces, broken = tracer.packed.result(calls)
    escaped: set = set()
    for t in output_tensors(out):
        tag = tracer.tag_of(t)
        if tag is not None:
            escaped |= tag.sources | tag.carried
    tracer.loose.feed(output_tensors(out))  # a loose parameter's values leave the model
    return Trace(calls, consumers, pieces, escaped, carried_by, broken, head_local, module_inputs,
                 tracer.read_directly, tracer.readers, plain_args, example_inputs, tuple(tracer.loose.meetings),
                 frozenset(tracer.loose.fed), tuple(tracer.head_cuts))
