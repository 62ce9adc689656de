"""Expert parallelism in the figures: what spreading a mixture-of-experts model's experts over `ep` ranks
(`tpkit.expert_parallel`) changes in one rank's memory and step time, on top of the same setup without it.

What a rank of an expert group does (`tpkit.experts`), and what the estimates take from it:
* its weights: each fused experts module's E experts split by the split rule over the ep ranks (6 over 4: 2, 2, 1,
  1), so the fullest rank (rank 0) holds ceil(E / ep) of them, whole: tensor parallelism leaves them whole (the
  plan's fused_experts "whole", `tpkit.KEEP_EXPERTS_WHOLE`); their gradients and AdamW states follow them. DDP
  leaves them alone: each expert tensor's gradient is all-reduced once per step over the expert-data group instead
  (`edp`: the dp x cp x tp / ep ranks holding the same experts; none at edp 1). At runtime FSDP2 shards them over
  edp (`tpkit.data_parallel`); the estimates still count them whole and all-reduced there, an upper bound on their
  memory at rest when edp > 1;
* every MoE layer's messages: forward, an all-to-all of the expert counts (E int64s), one of the rank's (row,
  choice) pairs to their experts' ranks (n / tp rows x k choices x H: each tp rank dispatches its own share of the
  rows) and the reverse one of the results; backward, the reverse of those two. Two forward, two backward (two
  forward at inference), each priced with the machine's "all_to_all" figures over ep ranks
  (`MachineRates.collective`, as context parallelism's); their bytes are one rank's send buffer, of which
  (ep - 1) / ep leaves the rank under uniform routing;
* its experts' work: the pairs it receives. Under uniform routing each of the ep ranks' n / tp x k pairs goes to
  each expert alike, so the rank holding c of the E experts receives ep x c / E of a rank's pairs (about as many as
  it sends: the expert work per rank is what the whole-experts step does divided by tp, not by ep; what ep
  divides is the expert weights each rank holds and reads). `imbalance` multiplies what the fullest rank
  receives: the busiest rank's load over the uniform one. Default `DEFAULT_IMBALANCE` = 1.0: uniform routing, what
  a router trained with a load-balancing loss aims for; a router that favours some experts makes the step wait for
  their ranks (give the measured ratio, e.g. 1.2).

How: the step is traced (`fake_step.trace_step(ep=)`) with every fused experts module replaced by the runtime's own
`DispatchedExperts` for ep rank `rank`, its exchange (`tpkit.experts.dispatch.exchange`) run with the sizes uniform
routing gives (`UniformExperts`): its ops, its all-to-alls (recorded as the "ep" group's collectives), its parameter
shapes, the bytes it saves for backward and its peak are then the rank's own. Formulas for what the trace does not
see: `uniform_sizes` / `layer_bytes` (the messages), `expert_data_seconds` (the edp all-reduce), `ExpertLayers`
(the experts' parameters at any ep, for the memory figures and `tpkit analyze`'s table).
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..convert.families.experts import FusedExperts, experts_in, fused_experts
from ..experts.dispatch import ExpertOwners, exchange
from ..experts.module import DispatchedExperts
from ..layout import split_sizes
from .calls import with_layers

DEFAULT_IMBALANCE = 1.0  # the busiest expert rank's received pairs over the uniform share (1.0: uniform routing)
COUNT_BYTES = 8  # an expert count (int64)
EXPERTS_NOTE = ("expert parallelism: ep ranks share each MoE layer's experts (ceil(E / ep) whole experts on the "
                "fullest rank, TP keeping them whole), traced with the tokens dispatched as uniform routing sends "
                "them; each layer's all-to-alls over ep and the experts' gradients summed over the ranks holding the "
                "same ones")


@dataclasses.dataclass(frozen=True)
class ExpertLayers:
    """A model's fused experts modules (`infos`, one per module) and the bytes of one of their parameters."""

    infos: tuple[FusedExperts, ...]
    item: int

    @property
    def num_experts(self) -> int:
        return min(i.num_experts for i in self.infos)

    @property
    def total(self) -> int:
        """Parameters of every expert of every module."""
        return sum(i.num_experts * expert_parameters(i) for i in self.infos)

    def held(self, ep: int, tp: int = 1, rank: int = 0) -> int:
        """Parameters ep rank `rank` holds: its experts of every module, whole (ep > 1); at ep 1, what the TP
        plan's default holds at `tp` (`experts_tp`: every expert's intermediate features split)."""
        if ep > 1:
            return sum(split_sizes(i.num_experts, ep)[rank] * expert_parameters(i) for i in self.infos)
        return sum(i.num_experts * expert_parameters(i, tp_features(i, tp)) for i in self.infos)


def expert_parameters(info: FusedExperts, features: int | None = None) -> int:
    """Parameters of one expert (its up / gate-up and down slices) holding `features` of its intermediate ones."""
    f = info.intermediate if features is None else features
    return (info.pieces + 1) * info.hidden * f


def tp_features(info: FusedExperts, tp: int) -> int:
    """Intermediate features per expert rank 0 holds under `experts_tp` at `tp` (the unit rule of
    `convert.families.experts.expert_layouts`; all of them when they cannot be split)."""
    i = info.intermediate
    if tp == 1 or i < tp:
        return i
    unit = next(u for u in (8, 4, 2, 1) if i % u == 0 and i // u >= tp)
    return split_sizes(i // unit, tp)[0] * unit


def expert_layers(model_or_config, dtype: torch.dtype | None = None) -> ExpertLayers | str:
    """The fused experts modules `tpkit.expert_parallel` would spread (a config: built weightless at full depth),
    or why there are none to spread."""
    if isinstance(model_or_config, nn.Module):
        model = model_or_config
    else:
        layers = getattr(model_or_config, "num_hidden_layers", None)
        if not isinstance(layers, int) or not hasattr(model_or_config, "model_type"):
            return f"{type(model_or_config).__name__} is not a Hugging Face config the estimates can build"
        model = with_layers(model_or_config, None, layers, dtype or torch.bfloat16)
    named, refused = experts_in(model)
    found = [info for _, info in named]
    if refused:
        return "experts tpkit cannot dispatch exactly: " + "; ".join(refused[:2])
    if not found:
        return (f"{type(model).__name__} has no fused experts module (3-D gate_up_proj / up_proj and down_proj, as "
                f"transformers' Qwen3-MoE, Mixtral, DeepSeek, gpt-oss keep them)")
    item = next((p.element_size() for p in model.parameters()), 2) if dtype is None else dtype.itemsize
    return ExpertLayers(tuple(found), item)


def has_experts_config(config) -> bool:
    """A config that names more than one routed expert (the attributes transformers' MoE configs use)."""
    return any(isinstance(getattr(config, a, None), int) and getattr(config, a) > 1
               for a in ("num_experts", "num_local_experts", "n_routed_experts"))


def memory_experts(model_or_config, dtype: torch.dtype, ep: int, tp: int, dp: int, cp: int,
                   modelled: bool = True) -> ExpertLayers | None:
    """The experts `estimate_memory` counts apart (None: none), `ep` checked against them and against the layout of
    dp x cp x tp ranks; ep > 1 is estimated for a transformer the estimates model (`modelled`)."""
    config = getattr(model_or_config, "config", None) if isinstance(model_or_config, nn.Module) else model_or_config
    if ep > 1 and not modelled:
        raise ValueError(f"estimate_memory: expert parallelism (ep={ep}) is estimated for a Hugging Face model with "
                         f"fused experts; {type(model_or_config).__name__} has no config tpkit models")
    if ep == 1 and not has_experts_config(config):
        return None
    layers = expert_layers(model_or_config, dtype)
    check_experts(ep, layers, type(model_or_config).__name__)
    check_layout(ep, tp, dp * cp * tp, "dp_size x cp x world_size", f"pass dp_size={replicas_for(ep, tp * cp)} "
                 f"(dp_mode 'ddp' or 'fsdp'): the replicas whose ranks make up the expert group")
    return layers if isinstance(layers, ExpertLayers) else None


def replicas_for(ep: int, ranks: int) -> int:
    """The fewest data-parallel replicas of `ranks` (cp x tp) ranks an expert group of `ep` can be carved from."""
    return ep // math.gcd(ep, ranks)


def valid_eps(tp: int, ranks: int, num_experts: int) -> list[int]:
    """Expert-parallel sizes > 1 a layout of `ranks` = dp x cp x tp ranks can carve (`tpkit.comm.groups`): multiples
    of tp dividing `ranks`, at most the experts."""
    return [e for e in range(max(tp, 2), min(ranks, num_experts) + 1) if e % tp == 0 and ranks % e == 0]


def check_ep(ep: int, imbalance: float = DEFAULT_IMBALANCE) -> None:
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a positive int, got {ep!r}")
    if isinstance(imbalance, bool) or not isinstance(imbalance, (int, float)) or not imbalance >= 1.0:
        raise ValueError(f"ep_imbalance must be a number >= 1.0 (the busiest expert rank's load over the uniform one; "
                         f"1.0: uniform routing), got {imbalance!r}")


def check_layout(ep: int, tp: int, ranks: int, what: str = "dp x cp x tp", fix: str = "") -> None:
    """`ep` can be carved from `ranks` (= `what`) ranks at TP `tp`, or a ValueError naming what would fix it."""
    if ep > 1 and ep % tp:
        raise ValueError(f"ep {ep} is not a multiple of tp {tp}: an expert group holds whole tp groups (each tp rank "
                         f"dispatches its own share of the rows); choose ep among multiples of {tp}")
    if ep > 1 and ranks % ep:
        valid = [e for e in range(tp, ranks + 1, tp) if ranks % e == 0]
        raise ValueError(f"ep {ep} does not divide {what} = {ranks} ranks: every expert group holds ep ranks of the "
                         f"layout; choose ep among {valid}" + (f", or {fix}" if fix else ""))


def check_experts(ep: int, layers: ExpertLayers | str, who: str) -> None:
    """`ep` > 1 needs fused experts and at least ep of them per module."""
    if ep == 1:
        return
    if isinstance(layers, str):
        raise ValueError(f"expert parallelism (ep={ep}) spreads a mixture-of-experts model's experts: {layers}; use "
                         f"ep=1")
    if ep > layers.num_experts:
        raise ValueError(f"ep {ep} exceeds the {layers.num_experts} experts of {who}'s MoE layers: every rank of the "
                         f"expert group needs one; choose ep <= {layers.num_experts}")


def uniform_sizes(pairs: int, owners: ExpertOwners, rank: int,
                  imbalance: float = DEFAULT_IMBALANCE) -> tuple[list[int], list[int]]:
    """The sizes of `exchange` on ep rank `rank` under uniform routing, every rank routing `pairs` (row, choice)
    pairs: (pairs sent to each expert: an even share each; pairs received from each source for each local expert,
    source-major). It receives `imbalance` x ep x c / E x pairs in all for the c experts it holds: its own pairs for
    them as it sends them, the rest evenly from the other ranks."""
    ep, c, first = len(owners.counts), owners.counts[rank], owners.starts[rank]
    sent = split_sizes(pairs, owners.num_experts)
    own = sent[first:first + c]
    received = math.ceil(imbalance * ep * c * pairs / owners.num_experts - 1e-9)
    others = iter(split_sizes(max(received - sum(own), 0), ep - 1)) if ep > 1 else iter(())
    got = []
    for source in range(ep):
        got += own if source == rank else split_sizes(next(others), c)
    return sent, got


def layer_bytes(tokens: int, top_k: int, hidden: int, item: int, num_experts: int, ep: int, tp: int = 1,
                rank: int = 0, imbalance: float = DEFAULT_IMBALANCE) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """One MoE layer's all-to-all send buffers on ep rank `rank` (also tp rank `rank % tp`) for a step of `tokens`
    rows (the local batch's): (forward: counts, pairs out, results back; backward: the results' gradients out, the
    pairs' gradients back). Bytes leaving the rank are (ep - 1) / ep of the pairs' under uniform routing."""
    pairs = split_sizes(tokens, tp)[rank % tp] * top_k
    received = sum(uniform_sizes(pairs, ExpertOwners.split(num_experts, ep), rank, imbalance)[1])
    out, back = pairs * hidden * item, received * hidden * item
    return (num_experts * COUNT_BYTES, out, back), (out, back)


class UniformExperts(DispatchedExperts):
    """`DispatchedExperts` whose exchange runs with the sizes uniform routing gives (`uniform_sizes`), for a fake
    step: the counts all-to-all is made (on zeros: the sizes do not come from it) and the runtime's own exchange
    runs, ops and messages as a real rank's."""

    def __init__(self, original: nn.Module, info: FusedExperts, ep, tp, imbalance: float = DEFAULT_IMBALANCE):
        super().__init__(original, info, ep, tp)
        self.imbalance = imbalance

    def route(self, rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, k = index.shape
        ep, mine = self.ep.world_size, self.count
        self.ep.all_to_all(index.new_zeros(self.owners.num_experts), 0, 0, self.owners.counts, [mine] * ep)
        sent, got = uniform_sizes(n * k, self.owners, self.ep.rank, self.imbalance)
        return exchange(rows, index, weights, self.ep, self.owners, self.compute, sent, got)


def spread_experts(model: nn.Module, ep_comm, tp_comm, imbalance: float = DEFAULT_IMBALANCE) -> int:
    """Replace every fused experts module of a weightless converted copy by its `UniformExperts` on `ep_comm`'s
    rank (`tp_comm`: the copy's tensor-parallel group); returns how many were replaced."""
    found = [(name, info) for name, m in model.named_modules() if isinstance(info := fused_experts(m), FusedExperts)]
    for name, info in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, UniformExperts(getattr(parent, child), info, ep_comm, tp_comm, imbalance))
    return len(found)


def expert_shapes(model: nn.Module) -> tuple[tuple[int, ...], ...]:
    """The shapes of the expert weights a traced copy holds (its `DispatchedExperts`' parameters)."""
    return tuple(tuple(p.shape) for m in model.modules() if isinstance(m, DispatchedExperts) for p in m.parameters())


def expert_data_seconds(tensor_bytes, rates, edp: int, in_step: float) -> float:
    """The expert weights' gradients summed over the expert-data group, one all-reduce per tensor (`tensor_bytes`:
    each one's bytes) at `rates` (`machine.MachineRates`), each with a collective's in-step cost."""
    if edp <= 1:
        return 0.0
    cost = rates.collective("all_reduce", edp)
    return sum(cost.seconds(n) + in_step for n in tensor_bytes)


@dataclasses.dataclass(frozen=True)
class ExpertMemory:
    """Expert memory per rank by ep at TP `tp` (`tpkit analyze`): for each ep, the experts the fullest rank holds of
    each MoE layer, their weights' bytes, those bytes in `mode` (training: with gradients and AdamW states) and the
    rank's total with everything else as the report counted it at tp (`rest`); `budget`: a device's memory."""

    tp: int
    mode: str
    num_experts: int
    layers: int
    budget: int | None
    rest: float
    rows: tuple[tuple[int, int, float, float], ...]  # (ep, experts per rank, expert weight bytes, in mode)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "rows": [dict(zip(("ep", "experts", "weights", "memory"), r))
                                                     for r in self.rows]}

    def summary(self, width: int | None = None) -> str:
        from ..tables import Column, format_bytes, render_table, wrap_text

        training = self.mode == "training"
        what = "weights + grads + AdamW" if training else "weights"
        columns = [Column("ep"), Column("experts/rank"), Column("expert weights", drop=1),
                   *([Column(f"experts ({what})")] if training else []), Column("per rank")]
        if self.budget:
            columns.append(Column(f"fits {format_bytes(self.budget)}", "left"))
        rows = [[str(ep), f"{n} of {self.num_experts}" + (" (TP split)" if ep == 1 and self.tp > 1 else ""),
                 format_bytes(w), *([format_bytes(m)] if training else []), format_bytes(self.rest + m),
                 *(["yes" if self.rest + m <= self.budget else "no"] if self.budget else [])]
                for ep, n, w, m in self.rows]
        title = f"expert memory per rank by expert parallelism (tp {self.tp}, {self.mode}: {what})"
        note = (f"{self.layers} MoE layers of {self.num_experts} experts; ep ranks of dp x cp x tp share them "
                f"(tpkit.expert_parallel: ep a multiple of tp dividing dp x cp x tp), ceil(E / ep) whole experts on "
                f"the fullest rank, TP keeping them whole; ep 1: as the TP plan splits them; per rank: the rest of the "
                f"model as counted above at tp {self.tp}, activations not included")
        return "\n".join([render_table(title, columns, rows, width), wrap_text(note, width, "", "  ")])


def expert_memory(layers: ExpertLayers, tp: int, mode: str, held: float, budget: int | None = None) -> ExpertMemory:
    """The `ExpertMemory` table at TP `tp`: `held` is what the report counts per rank in `mode` at tp (experts as
    the TP plan splits them included); ep 1 and the multiples of tp doubling up to the experts (and E itself)."""
    factor = 1.0 if mode == "inference" else 2 + 8 / layers.item  # gradients, AdamW's two fp32 states
    e = layers.num_experts
    eps = sorted({1} | {tp << i for i in range(16) if 1 < tp << i <= e} | ({e} if e % tp == 0 else set()))
    rows = tuple((ep, -(-e // ep), layers.held(ep, tp) * layers.item, layers.held(ep, tp) * layers.item * factor)
                 for ep in eps)
    rest = held - rows[0][3]
    return ExpertMemory(tp, mode, e, len(layers.infos), budget, rest, rows)
