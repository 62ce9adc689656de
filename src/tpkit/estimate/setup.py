"""A setup: how a model runs on pp x dp x cp x tp devices, the record every estimate of speed and memory prices
(`predict.predict`) and the search enumerates (`search.candidates`).

`tp` ranks split each layer (the architecture families' `choices`: attention by heads or whole, the LM head
vocab-parallel or replicated, experts TP or EP; `sequence_parallel` between them), `cp` ranks share each training
sequence (`tpkit.context_parallel`, `cp_method`), `dp` replicas take a share of the batch (DDP, FSDP2, or inference
`replicas`; FSDP2 shards over dp x cp, every rank that holds the same weights: `engine`), `ep` ranks of dp x cp x tp
share a mixture-of-experts model's experts (`tpkit.expert_parallel`: experts kept whole by TP, tokens sent to them by
all-to-all, `ep_imbalance` the busiest rank's load over the uniform one; the rest of the model as without it), `pp`
pipeline stages run `microbatches` through `schedule`, `stages_per_rank` each, and `recompute` trades the backward's
saved activations for forward work again.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .context import check_cp
from .experts import DEFAULT_IMBALANCE, check_ep, check_layout

DP_MODES = ("ddp", "fsdp", "replicas")  # replicas: inference copies that each take a share of the batch
RECOMPUTE = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True)
class Setup:
    """How a model runs on pp x dp x cp x tp devices (see the module docstring). `choices`: (family, alternative)
    taken for every proposal of that family that offers it, e.g. ("attention", "whole")."""

    tp: int
    dp: int = 1
    dp_mode: str | None = None
    sequence_parallel: bool = False
    recompute: str = "none"
    choices: tuple[tuple[str, str], ...] = ()
    pp: int = 1
    microbatches: int = 1
    stages_per_rank: int = 1
    schedule: str = "1f1b"
    cp: int = 1
    cp_method: str = "auto"
    ep: int = 1
    ep_imbalance: float = DEFAULT_IMBALANCE

    def __post_init__(self):
        if self.tp < 1 or self.dp < 1 or self.pp < 1 or self.microbatches < 1 or self.stages_per_rank < 1:
            raise ValueError(f"Setup: tp, dp, pp, microbatches and stages_per_rank must be >= 1, got tp={self.tp}, "
                             f"dp={self.dp}, pp={self.pp}, microbatches={self.microbatches}, "
                             f"stages_per_rank={self.stages_per_rank}")
        if self.dp > 1 and self.dp_mode not in DP_MODES:
            raise ValueError(f"Setup: dp={self.dp} needs dp_mode in {DP_MODES}, got {self.dp_mode!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Setup: recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        check_cp(self.cp, self.cp_method)
        check_ep(self.ep, self.ep_imbalance)
        check_layout(self.ep, self.tp, self.dp * self.cp * self.tp)
        if self.ep > 1 and any(f == "fused_experts" and c != "whole" for f, c in self.choices):
            raise ValueError(f"Setup: ep={self.ep} spreads the experts over the expert group; tensor parallelism keeps "
                             f"them whole, so no other fused_experts choice: got {dict(self.choices)}")

    @property
    def devices(self) -> int:
        return self.pp * self.tp * self.dp * self.cp

    @property
    def engine(self) -> int:
        """Ranks the data-parallel engine spans: FSDP2 shards over dp x cp (every rank holding the same weights, as
        tpkit's runs and torchtitan shard them), DDP averages over dp."""
        return self.dp * self.cp if self.dp_mode == "fsdp" else self.dp

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (the expert-data group): dp x cp x tp / ep; 1 without expert parallelism."""
        return self.dp * self.cp * self.tp // self.ep if self.ep > 1 else 1

    def choose(self) -> dict[str, str]:
        """The families' alternatives taken; under expert parallelism TP keeps the experts whole."""
        return {**dict(self.choices), **({"fused_experts": "whole"} if self.ep > 1 else {})}

    def label(self) -> str:
        parts = [f"pp{self.pp} {self.schedule} m{self.microbatches}"] if self.pp > 1 else []
        parts += [f"tp{self.tp}"] + ([f"cp{self.cp}" + (f" {self.cp_method}" if self.cp_method != "auto" else "")]
                                     if self.cp > 1 else [])
        parts += [f"ep{self.ep}" + (f" x{self.ep_imbalance:g} load" if self.ep_imbalance != 1 else "")] \
            if self.ep > 1 else []
        parts += ([f"dp{self.dp} {self.dp_mode}"] if self.dp > 1
                  else [f"{self.dp_mode} over cp"] if self.engine > 1 else [])
        parts += ["sp"] if self.sequence_parallel else []
        parts += [f"recompute {self.recompute}"] if self.recompute != "none" else []
        parts += [f"{family} {label}" for family, label in self.choices]
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "choices": dict(self.choices)}
