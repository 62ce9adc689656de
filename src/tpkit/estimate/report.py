"""What an estimate returns: bytes by part on one device and on the most loaded rank, and their rendering.

Kept apart from the arithmetic so that the formula path and the measured path build the same result.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..tables import Column, format_bytes, render_table, wrap_text

MODES = ("inference", "training")  # what a MemoryEstimate describes; the speed estimate splits inference further


@dataclass
class Breakdown:
    """Bytes on one rank."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer_states: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0
    communication_buffers: float = 0.0

    @property
    def total(self) -> float:
        return (self.parameters + self.gradients + self.optimizer_states + self.activations + self.kv_cache
                + self.communication_buffers)

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


@dataclass
class MemoryEstimate:
    """Memory on one device (`single`) and on the most loaded of `world_size` TP ranks (`per_rank`)."""

    world_size: int
    mode: str
    dtype: str
    optimizer: str
    batch_size: int
    seq_len: int | None
    sequence_parallel: bool
    recompute: str
    single: Breakdown
    per_rank: Breakdown
    parameters_total: int
    parameters_per_rank: int
    largest_collective: str = ""
    notes: list[str] = field(default_factory=list)
    dp_size: int = 1                     # data-parallel replicas of this TP group (2-D layout)
    dp_mode: str | None = None           # "fsdp" (parameters, grads, states sharded) or "ddp" (replicated)
    activation_method: str = "formula"   # "traced" (saved bytes of a fake forward) | "formula" | "measured"
    activations_per_layer: float | None = None   # per rank, one transformer layer (traced configs)
    activations_formula: float | None = None     # the Korthikanti-style cross-check, per rank
    cp: int = 1                          # context-parallel ranks sharing each sequence (training)
    cp_method: str | None = None         # their attention: "all_to_all" or "ring" (None at cp 1)
    ep: int = 1                          # expert-parallel ranks sharing a MoE model's experts
    expert_parameters_per_rank: int | None = None  # expert weights on the fullest rank (None: no experts counted)

    @property
    def total(self) -> float:
        return self.per_rank.total

    @property
    def savings_bytes(self) -> float:
        return self.single.total - self.per_rank.total

    @property
    def savings_percent(self) -> float:
        return 100.0 * self.savings_bytes / self.single.total if self.single.total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "mode": self.mode, "dtype": self.dtype, "optimizer": self.optimizer,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "sequence_parallel": self.sequence_parallel,
                "recompute": self.recompute, "parameters_total": self.parameters_total,
                "parameters_per_rank": self.parameters_per_rank, "single_device": self.single.to_dict(),
                "per_rank": self.per_rank.to_dict(), "savings_bytes": self.savings_bytes,
                "savings_percent": self.savings_percent, "largest_collective": self.largest_collective,
                "dp_size": self.dp_size, "dp_mode": self.dp_mode, "activation_method": self.activation_method,
                "activations_per_layer": self.activations_per_layer,
                "activations_formula": self.activations_formula, "cp": self.cp, "cp_method": self.cp_method,
                "ep": self.ep, "expert_parameters_per_rank": self.expert_parameters_per_rank,
                "notes": list(self.notes)}

    def summary(self, width: int | None = None) -> str:
        """A table (fitted to `width` columns; None: natural width): each part on one device and per rank."""
        caption = (f"batch {self.batch_size}" + (f" x seq {self.seq_len}" if self.seq_len else "")
                   + (", sequence parallel" if self.sequence_parallel else "")
                   + (f", {self.recompute} recompute" if self.recompute != "none" else "")
                   + (f", cp {self.cp} {self.cp_method}" if self.cp > 1 else "")
                   + (f", ep {self.ep}" if self.ep > 1 else ""))
        rows = []
        for name in ("parameters", "gradients", "optimizer_states", "activations", "kv_cache",
                     "communication_buffers"):
            one, many = getattr(self.single, name), getattr(self.per_rank, name)
            if one or many:
                rows.append([name.replace("_", " "), format_bytes(one), format_bytes(many)])
        rows.append(["total", format_bytes(self.single.total), format_bytes(self.per_rank.total)])
        columns = [Column("part", "left"), Column("1 device"), Column(f"per rank (t={self.world_size})")]
        lines = [render_table(f"memory: {self.mode}, {self.dtype} ({caption})", columns, rows, width),
                 wrap_text(f"saves {format_bytes(self.savings_bytes)} per rank ({self.savings_percent:.1f}%); largest "
                           f"collective: {self.largest_collective}", width)]
        lines += [wrap_text(f"note: {note}", width, "", "  ") for note in self.notes]
        return "\n".join(lines) + "\n"
