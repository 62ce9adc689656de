"""How long a training sequence fits, by context parallelism: activation memory per rank for a few sequence lengths at
each cp, and the longest sequence whose activations fit what a device has left after the weights, gradients and
optimizer states (`tpkit analyze --mode training` shows it).

Activations grow with the sequence (linearly, and quadratically for an eager kernel's scores) while the weights do
not, so past some length no TP size helps and the sequence itself has to be split: cp ranks each hold 1/cp of its
tokens (`context.py`). The figures are the formula's (`activations.transformer_activation_bytes`, Korthikanti et al.
adapted to the architecture, with cp): a trace per length would cost seconds each, the formula nothing, and
`tpkit estimate --mode training --cp C` traces the one length asked for. The longest length is a bisection on that
formula, which never falls as the sequence grows.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..tables import Column, format_bytes, render_table, wrap_text
from .activations import transformer_activation_bytes
from .config import TransformerShape
from .context import attention_method

LIMIT = 1 << 24  # the longest sequence looked for (16M tokens)


@dataclasses.dataclass(frozen=True)
class SequenceRow:
    """One cp: its attention method (None at cp 1), activation bytes per rank at each length, and the longest
    sequence that fits (None without a budget; 0 when not even one token does)."""

    cp: int
    method: str | None
    activations: tuple[float, ...]
    longest: int | None


@dataclasses.dataclass(frozen=True)
class SequenceMemory:
    """Activation memory per rank by sequence length and cp at TP `tp` (see the module docstring). `held`: the
    bytes a rank holds besides activations (weights, gradients, optimizer states: replicated over cp); `budget`: a
    device's memory (None: unknown)."""

    tp: int
    batch_size: int
    dtype: str
    budget: int | None
    held: float
    seq_lens: tuple[int, ...]
    rows: tuple[SequenceRow, ...]
    max_positions: int | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self, width: int | None = None) -> str:
        """The table, then what it assumes."""
        fit = f"longest fitting {format_bytes(self.budget)}" if self.budget else "longest fitting"
        columns = [Column("cp"), Column("devices", drop=2), Column("attention", "left", drop=1),
                   *(Column(_tokens(s)) for s in self.seq_lens), Column(fit)]
        rows = [[str(r.cp), str(self.tp * r.cp), r.method or "-", *(format_bytes(a) for a in r.activations),
                 self._longest(r.longest)] for r in self.rows]
        title = (f"training activations per rank by sequence length (tp {self.tp}, batch {self.batch_size}, "
                 f"{self.dtype}; formula)")
        lines = [render_table(title, columns, rows, width)]
        lines += [wrap_text(note, width, "", "  ") for note in self.notes]
        return "\n".join(lines)

    def _longest(self, n: int | None) -> str:
        if n is None:
            return "no budget"
        if n == 0:
            return "none"
        text = f">= {_tokens(n)}" if n >= LIMIT else _tokens(n)
        return text + (" (> max positions)" if self.max_positions and n > self.max_positions else "")


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


def activation_bytes(shape: TransformerShape, seq_len: int, bytes_per_element: int, tp: int = 1, cp: int = 1,
                     batch_size: int = 1, attention: str = "flash", cp_method: str = "auto") -> float:
    """Training activations on the fullest rank at tp x cp (all parts, the context-parallel working set included)."""
    return sum(transformer_activation_bytes(shape, batch_size, seq_len, bytes_per_element, tp, attention=attention,
                                            cp=cp, cp_method=cp_method).values())


def longest_sequence(shape: TransformerShape, room: float, bytes_per_element: int, tp: int = 1, cp: int = 1,
                     batch_size: int = 1, attention: str = "flash", cp_method: str = "auto") -> int:
    """The longest sequence (up to `LIMIT`) whose activations per rank fit `room` bytes; 0 when none does."""
    def fits(n: int) -> bool:
        return activation_bytes(shape, n, bytes_per_element, tp, cp, batch_size, attention, cp_method) <= room
    if not fits(1):
        return 0
    lo, hi = 1, LIMIT
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def default_lengths(max_positions: int | None, count: int = 6) -> tuple[int, ...]:
    """`count` lengths doubling up to the model's positions (4096 when it does not say)."""
    top = max_positions or 4096
    return tuple(sorted({max(top >> k, 1) for k in range(count)}))


def sequence_memory(shape: TransformerShape, bytes_per_element: int, tp: int = 1, cps=(1, 2, 4, 8),
                    seq_lens: tuple[int, ...] | None = None, batch_size: int = 1, budget: int | None = None,
                    held: float = 0.0, attention: str = "flash", cp_method: str = "auto",
                    max_positions: int | None = None, dtype: str = "", notes: tuple[str, ...] = ()) -> SequenceMemory:
    """The table at TP `tp` for each cp in `cps` (see `SequenceMemory`)."""
    seq_lens = tuple(seq_lens or default_lengths(max_positions))
    rows = []
    for cp in cps:
        method = attention_method(shape, tp, cp, cp_method) if cp > 1 else None
        acts = tuple(activation_bytes(shape, s, bytes_per_element, tp, cp, batch_size, attention, cp_method)
                     for s in seq_lens)
        longest = (longest_sequence(shape, budget - held, bytes_per_element, tp, cp, batch_size, attention, cp_method)
                   if budget else None)
        rows.append(SequenceRow(cp, method, acts, longest))
    what = (f"the budget holds {format_bytes(held)} of weights, gradients and AdamW states per rank (replicated over "
            f"cp) besides the activations" if budget else "no memory budget: pass device_memory (--device-memory)")
    return SequenceMemory(tp, batch_size, dtype, budget, held, seq_lens, tuple(rows), max_positions,
                          (*notes, what))
