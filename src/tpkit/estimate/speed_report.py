"""What a speed estimate returns: a row per world size (work, time and its parts, throughput, speedup) and the
table of them. Its own module so both pricings fill it, the roofline of a datasheet (`speed.py`) and the op-level
model of a measured machine (`machine_speed.py`), without importing each other.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..tables import Column, render_table, wrap_text


@dataclass
class SpeedRow:
    """One world size: per-rank work and time of one step (seconds)."""

    world_size: int
    flops_per_rank: float
    bytes_per_rank: float
    communication_bytes: float
    collectives: int
    compute_s: float
    memory_s: float
    communication_s: float
    total_s: float
    tokens_per_s: float
    speedup: float = 1.0
    bound: str = ""
    memory_bytes: float = 0.0   # measured machines: the most tensor bytes the rank's traced step holds
    process_bytes: float = 0.0  # ... and what its process holds at that peak (imports and runtime added)


@dataclass
class SpeedEstimate:
    """Step (or token) time and speedup per world size."""

    hardware: str
    interconnect: str
    mode: str
    dtype: str
    batch_size: int
    seq_len: int | None
    rows: list[SpeedRow]
    notes: list[str] = field(default_factory=list)
    unit: str = "tokens"  # what `tokens_per_s` counts: tokens, or samples for measured modules
    # what the three time columns hold: a roofline's compute / memory / communication, or (priced op by op on a
    # measured machine, `machine_speed.py`) kernels / the framework's fixed costs / communication
    parts: tuple[str, str, str] = ("compute", "memory", "comm")

    def row(self, world_size: int) -> SpeedRow:
        for r in self.rows:
            if r.world_size == world_size:
                return r
        raise KeyError(f"world size {world_size} not estimated; have {[r.world_size for r in self.rows]}")

    def speedup(self, world_size: int) -> float:
        return self.row(world_size).speedup

    def to_dict(self) -> dict[str, Any]:
        return {"hardware": self.hardware, "interconnect": self.interconnect, "mode": self.mode, "dtype": self.dtype,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "unit": self.unit,
                "rows": [asdict(r) for r in self.rows], "notes": list(self.notes), "parts": list(self.parts)}

    def summary(self, width: int | None = None) -> str:
        """A table per world size (fitted to `width` columns; None: natural width), then the notes."""
        unit = "token" if self.mode == "decode" else "step"
        seq = f" x seq {self.seq_len}" if self.seq_len else ""
        names = ("world size", *self.parts, f"time/{unit}", f"{self.unit}/s", "speedup", "bound")
        rows = [[str(r.world_size), _ms(r.compute_s), _ms(r.memory_s), _ms(r.communication_s), _ms(r.total_s),
                 f"{r.tokens_per_s:,.0f}", f"{r.speedup:.2f}x", r.bound] for r in self.rows]
        title = f"speed: {self.mode}, {self.dtype}, batch {self.batch_size}{seq}, {self.hardware} over {self.interconnect}"
        lines = [render_table(title, [Column(n) for n in names], rows, width)]
        lines += [wrap_text(f"note: {note}", width, "", "  ") for note in self.notes]
        return "\n".join(lines) + "\n"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"


