"""Sequence parallelism for converted models: where the residual stream is split along the sequence.

Between a row-wise layer and the next column-wise one, Megatron-style sequence parallelism keeps each rank's
slice of the tokens: rows reduce-scatter instead of all-reducing, and the per-token layers in between (the
residual stream and its norms) run on 1/N of the tokens. Two departures from Megatron, both because Hugging
Face modules read shapes from their inputs: the split starts at the first block that receives the hidden
states (a pre-hook scatters them there; masks and positions are built from the full embedding output), and
the all-gather sits at the output of the norm that feeds an attention or MLP block, not inside the column
layers, so those blocks see the whole sequence. The price: the backward of that gather is an all-reduce in
the column layers plus a slice, where Megatron does one reduce-scatter. Found from the trace:

- the entry: the first layer whose output feeds a column-wise layer (the first norm), and the outermost
  module that receives that layer's input tensor (the first block);
- the region: replicated layers fed only by row-wise layers, the entry's sources or the region itself; each
  must be a per-token norm, and none may feed the model's output (only a column-wise layer, the LM head,
  may leave the region).
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Mapping

from torch import nn

from ...nn import gather_from_region, mark_sequence_parallel, scatter_to_sequence_region
from ..errors import PlanError
from ..family import Checked, Choice, Draft, Family, Planned, Proposal
from ..modules import is_conv2d, is_feature_norm, is_linear
from ..styles import COLWISE, COLWISE_REP, REPLICATE, ROWWISE, SEQUENCE_PARALLEL, VOCAB_PARALLEL, Style

COLUMNS = (COLWISE, VOCAB_PARALLEL)


class SequenceParallelNorm(Style):
    name = SEQUENCE_PARALLEL
    description = ("a replicated per-token layer (norm) running on this rank's slice of the sequence; its gradient, "
                   "a partial sum, is summed over the ranks in the backward")


@dataclasses.dataclass(frozen=True)
class SequenceRegion:
    entry_block: str
    entry_arg: int | str    # where the hidden states enter that block: argument position or keyword
    norms: tuple[str, ...]     # per-token layers on the split sequence (gradients are partial sums)
    columns: tuple[str, ...]   # column-wise layers reading the (gathered) sequence
    rows: tuple[str, ...]      # row-wise layers that reduce-scatter it
    gathered: tuple[str, ...]  # norms whose output is all-gathered for the blocks that read it


def find_region(analysis, styles: Mapping[str, str]) -> SequenceRegion:
    """The sequence-parallel region of a model under `styles`, or PlanError saying why there is none."""
    t = analysis.trace
    if t is None:
        raise PlanError(f"sequence parallelism needs the model's dataflow, but its forward could not be traced "
                        f"({analysis.trace_error})")
    order = sorted(t.calls, key=lambda n: t.calls[n][0].order)
    entry = next((n for n in order if any(styles.get(c) in COLUMNS for c in t.consumers.get(n, ()))
                  and styles.get(n) not in (ROWWISE,) + COLUMNS), None)
    if entry is None:
        raise PlanError("sequence parallelism: no column-wise layer is fed by a replicated layer (a norm), so "
                        "there is no residual stream to split")
    entry_call = t.first(entry)
    whole = [n for n in order if styles.get(n, REPLICATE) in (REPLICATE, COLWISE_REP)
             and t.first(n).order < entry_call.order
             and (is_linear(analysis.leaves[n]) or is_conv2d(analysis.leaves[n]))]
    if whole:
        raise PlanError(f"sequence parallelism: layers before the first split block stay whole ({whole[:4]}); "
                        f"every attention / MLP block must be split for the sequence to stay split between them")
    block, arg = _outermost_receiver(t, entry_call.input_id, entry)
    rows = [n for n in order if styles.get(n) == ROWWISE]
    sharded = set(rows) | set(entry_call.input_tag.sources if entry_call.input_tag else ())
    norms, columns = [], []
    for name in order[order.index(entry):]:
        tag = t.first(name).input_tag
        if tag is None or not tag.sources or not tag.sources <= sharded | set(norms):
            continue
        style = styles.get(name, REPLICATE)
        if style in COLUMNS:
            columns.append(name)
        elif style == ROWWISE:
            continue
        elif style in (REPLICATE, SEQUENCE_PARALLEL) and is_feature_norm(analysis.leaves[name]):
            norms.append(name)
        else:
            raise PlanError(f"sequence parallelism: {name} ({type(analysis.leaves[name]).__name__}, {style!r}) reads "
                            f"the sequence-split hidden states but is not a per-token norm nor a split layer; split "
                            f"it or turn sequence parallelism off")
    for name in rows + norms:
        users = t.consumers.get(name, set()) - set(norms) - set(columns) - set(rows)
        if name in t.escaped or users:
            what = "the model output" if name in t.escaped else sorted(users)
            raise PlanError(f"sequence parallelism: {name}'s sequence-split output reaches {what}; only a "
                            f"column-wise layer (e.g. a vocab-parallel LM head, mode='training') may read it")
    gathered = [n for n in norms if any(styles.get(c) in COLUMNS for c in t.consumers.get(n, ()))]
    return SequenceRegion(block, arg, tuple(norms), tuple(columns), tuple(rows), tuple(gathered))


def _outermost_receiver(t, tensor_id: int, entry: str) -> tuple[str, int | str]:
    """The outermost ancestor of `entry` that received the entry's input tensor, and the argument it came in."""
    candidates = [n for n, ids in t.module_inputs.items()
                  if tensor_id in ids and n and entry.startswith(n + ".")]  # ancestors of the entry layer only
    if not candidates:
        raise PlanError(f"sequence parallelism: cannot find the block that receives {entry}'s input")
    block = min(candidates, key=lambda n: n.count("."))
    return block, t.module_inputs[block][tensor_id]


def install_entry(model: nn.Module, block: str, comm, arg: int | str = 0) -> None:
    """Split the hidden states along the sequence (dim -2) as they enter `block`, in the argument the trace
    saw them in (`arg`: a position or a keyword; the block may also take masks, which stay whole)."""
    model.get_submodule(block).register_forward_pre_hook(SequenceEntry(block, comm, arg), with_kwargs=True)


class SequenceEntry:
    """The pre-hook of `install_entry` (an object, so the model pickles and deep-copies)."""

    def __init__(self, block: str, comm, arg: int | str):
        self.block, self.comm, self.arg = block, comm, arg

    def __call__(self, mod, args, kwargs):
        arg, comm, block = self.arg, self.comm, self.block
        if isinstance(arg, int) and arg < len(args):
            x = args[arg]
            _check(block, x, comm.world_size)
            return args[:arg] + (scatter_to_sequence_region(x, comm, -2),) + args[arg + 1:], kwargs
        if isinstance(arg, str) and arg in kwargs:
            _check(block, kwargs[arg], comm.world_size)
            return args, dict(kwargs, **{arg: scatter_to_sequence_region(kwargs[arg], comm, -2)})
        raise ValueError(f"sequence parallelism: {block} was traced taking the hidden states as argument {arg!r}, "
                         f"but this call passes {len(args)} positional argument(s) and keywords {sorted(kwargs)}; "
                         f"call it the same way as the traced example")


def install_gather(norm: nn.Module, comm) -> None:
    """All-gather a norm's output along the sequence for the block that reads it.

    Attention and MLP modules of HF models take their shapes from their input, so they must see the whole
    sequence; the gather sits at the norm's output rather than inside the column layers. Its backward keeps
    this rank's slice: the column layers' input gradient is already summed over the ranks."""
    norm.register_forward_hook(SequenceGather(comm))


class SequenceGather:
    """The hook of `install_gather` (an object, so the model pickles and deep-copies)."""

    def __init__(self, comm):
        self.comm = comm

    def __call__(self, mod, args, out):
        return gather_from_region(out, self.comm, -2)


def _check(block: str, x, world: int) -> None:
    if x.dim() < 2 or x.shape[-2] % world:
        raise ValueError(f"sequence parallelism: the hidden states entering {block} have shape {tuple(x.shape)}; "
                         f"the sequence length (dim -2) must be a multiple of the world size {world}; pad it")


class SequenceParallel(Family):
    """Sequence parallelism as a conversion option (`parallelize(..., sequence_parallel=True)` or plan entries
    styled `sequence_parallel`), and as an alternative the planner offers in training mode."""

    name = "sequence_parallel"
    styles = (SequenceParallelNorm(),)

    def propose(self, draft: Draft, found) -> Iterator[Proposal]:
        """Off by default; on, where the plan has a region, splits its norms along the sequence."""
        if draft.mode != "training" or draft.world_size == 1 or draft.analysis.trace is None:
            return
        try:
            region = find_region(draft.analysis, draft.entries)
        except PlanError:
            return
        note = (f"split the residual stream and its {len(region.norms)} norms along the sequence (from "
                f"{region.entry_block} on)")
        yield Proposal(self.name, self.name, (Choice("off"), Choice("on", {n: SEQUENCE_PARALLEL for n in region.norms},
                                                                    note=note)))

    def validate(self, planned: Planned) -> Checked | None:
        """The region, its norms styled `sequence_parallel`, its row-wise layers built to reduce-scatter."""
        if not ((planned.sequence_parallel or SEQUENCE_PARALLEL in planned.styles.values()) and
                planned.world_size > 1):
            return None
        region = find_region(planned.analysis, planned.styles)
        stray = [n for n, s in planned.styles.items() if s == SEQUENCE_PARALLEL and n not in region.norms]
        if stray:
            raise PlanError(f"plan: {stray} are styled 'sequence_parallel' but are not per-token layers on the "
                            f"sequence-split residual stream (that region holds {list(region.norms[:4])}...)")
        return Checked(styles={n: SEQUENCE_PARALLEL for n in region.norms},
                       build={n: {"sequence_parallel": True} for n in region.rows}, state=region)

    def install(self, model: nn.Module, planned: Planned, checked: Checked | None, comm) -> None:
        if checked is None or checked.state is None:
            return
        region: SequenceRegion = checked.state
        install_entry(model, region.entry_block, comm, region.entry_arg)
        for n in region.norms:
            mark_sequence_parallel(model.get_submodule(n), comm)
        for n in region.gathered:
            install_gather(model.get_submodule(n), comm)
