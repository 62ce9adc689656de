"""A tensor-parallel plan as data: `{module name or glob: style}`, printable and JSON in / out.

Style strings are Hugging Face's `tp_plan` vocabulary, with a few of tpkit's own; aliases map to one
canonical style each (the table below is the whole vocabulary). A plan may also carry, per module, the
facts the planner found (`details`: attention heads, packed pieces) and why a layer stays replicated
(`reasons`), so a saved plan replays exactly and a reader sees what was decided.
"""
from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

# canonical style -> what it does
STYLES = {
    "colwise": "split output features (attention: whole heads; packed projections: piece by piece); "
               "output stays split for the row-wise layer that follows",
    "colwise_rep": "split output features, all-gather the output (e.g. an LM head for inference)",
    "vocab_parallel": "LM head split over the vocabulary, logits stay split; use vocab_parallel_cross_entropy",
    "rowwise": "split input features; its input is a column-wise layer's split output; one all-reduce",
    "rowwise_rep": "split input features of a full (replicated) input, slicing it locally; one all-reduce",
    "embedding_rowwise": "embedding split over the vocabulary (VocabParallelEmbedding); one all-reduce",
    "embedding_colwise": "embedding split over its features (ParallelEmbedding); one all-gather",
    "channelwise": "per-channel layer (BatchNorm) between a column and a row conv: holds this rank's channels",
    "sequence_parallel": "a replicated per-token layer (norm) running on this rank's slice of the sequence; its "
                         "gradient is a partial sum (tpkit.nn.sync_sequence_parallel_grads before the step)",
    "replicate": "every rank holds the whole module",
    "replicated_with_grad_allreduce": "every rank holds the whole module, applied to its own heads only (a "
                                      "per-head q/k norm): its gradient is summed over the ranks",
}
ALIASES = {
    "local_colwise": "colwise", "packed_colwise": "colwise", "colwise_gather_output": "colwise_rep",
    "gather_output": "colwise_rep", "local_rowwise": "rowwise", "packed_rowwise": "rowwise",
    "rowwise_split_input": "rowwise_rep", "vocab": "embedding_rowwise", "vocab_parallel_embedding": "embedding_rowwise",
    "replicated": "replicate", "none": "replicate",
    "local_packed_rowwise": "rowwise", "isolated": "replicate",
}
# Styles HF puts on container modules, where tpkit layers already do the communication themselves.
CONTAINER_NO_OPS = {"gather", "all_reduce", "local", "ep_router", "moe_identity_expert"}


class PlanError(ValueError):
    """A plan that cannot be applied: unknown style, an entry that names no module, conflicting entries."""


def canonical_style(style: str, where: str = "plan") -> str:
    """The canonical name of a style string (case-insensitive; aliases accepted)."""
    if not isinstance(style, str):
        raise PlanError(f"{where}: style must be a string, got {style!r}")
    s = style.strip().lower()
    s = ALIASES.get(s, s)
    if s in STYLES or s in CONTAINER_NO_OPS:
        return s
    raise PlanError(f"{where}: unknown style {style!r}; valid styles: {', '.join(sorted(STYLES))} "
                    f"(aliases: {', '.join(sorted(ALIASES))})")


def is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


class Plan(Mapping[str, str]):
    """`{module name or glob: style}` plus, per module, planner `details` and replicate `reasons`.

    Lookup (`style_for`) takes an exact name over any glob; two globs that both match one module with
    different styles are a conflict (`PlanError`). Patterns may leave out the base model prefix, as HF
    configs' `base_model_tp_plan` do (`layers.*.self_attn.q_proj` matches `model.layers.0.self_attn.q_proj`).
    """

    def __init__(self, entries: Mapping[str, str] | None = None, *, world_size: int | None = None,
                 mode: str = "inference", details: Mapping[str, dict] | None = None,
                 reasons: Mapping[str, str] | None = None, prefix: str | None = None):
        self.entries: dict[str, str] = {}
        for k, v in dict(entries or {}).items():
            self.entries[str(k)] = canonical_style(v, f"plan entry {k!r}")
        self.world_size = world_size
        self.mode = mode
        self.details = {k: dict(v) for k, v in dict(details or {}).items()}
        self.reasons = dict(reasons or {})
        self.prefix = prefix

    # Mapping protocol: the entries.
    def __getitem__(self, key: str) -> str:
        return self.entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"Plan(world_size={self.world_size}, mode={self.mode!r}, entries={self.entries!r})"

    def _matches(self, pattern: str, name: str) -> bool:
        if fnmatch.fnmatchcase(name, pattern):
            return True
        return bool(self.prefix) and fnmatch.fnmatchcase(name, f"{self.prefix}.{pattern}")

    def matching(self, pattern: str, names: Iterable[str]) -> list[str]:
        if not is_glob(pattern):
            wanted = {pattern, f"{self.prefix}.{pattern}" if self.prefix else pattern}
            return [n for n in names if n in wanted]
        return [n for n in names if self._matches(pattern, n)]

    def style_for(self, name: str, _globs: dict | None = None) -> str | None:
        """The style this plan gives module `name`, or None when no entry names it."""
        if name in self.entries:
            return self.entries[name]
        if self.prefix and name.startswith(self.prefix + ".") and name[len(self.prefix) + 1:] in self.entries:
            return self.entries[name[len(self.prefix) + 1:]]
        globs = self._globs() if _globs is None else _globs
        hits = {p: s for p, s in globs.items() if self._matches(p, name)}
        styles = set(hits.values())
        if len(styles) > 1:
            raise PlanError(f"plan: conflicting entries for module {name!r}: {hits}; give the module an exact "
                            f"entry or make the globs agree")
        return styles.pop() if styles else None

    def _globs(self) -> dict[str, str]:
        return {p: s for p, s in self.entries.items() if is_glob(p)}

    def resolve(self, names: Iterable[str]) -> dict[str, str]:
        """`{module name: style}` for every module an entry names; raises on entries naming no module."""
        names = list(names)
        known = set(names)
        for pattern in self.entries:
            if not is_glob(pattern) and (pattern in known or (self.prefix and f"{self.prefix}.{pattern}" in known)):
                continue
            if not self.matching(pattern, names):
                close = [n for n in names if n.split(".")[-1] == pattern.split(".")[-1]][:3]
                hint = f"; modules with the same last name: {close}" if close else ""
                raise PlanError(f"plan entry {pattern!r} names no module of the model{hint}")
        out = {}
        globs = self._globs()
        for n in names:
            s = self.style_for(n, globs)
            if s is not None:
                out[n] = s
        return out

    def updated(self, overrides: Mapping[str, str] | "Plan") -> "Plan":
        """A copy with `overrides` taking precedence: for every module an override names, the override's
        style wins over this plan's entry (user entries over auto ones)."""
        over = overrides if isinstance(overrides, Plan) else Plan(overrides)
        merged = Plan(self.entries, world_size=self.world_size, mode=self.mode, details=self.details,
                      reasons=self.reasons, prefix=self.prefix)
        for pattern, style in over.entries.items():
            for name in list(merged.entries):
                if name == pattern or (not is_glob(name) and merged._matches(pattern, name)):
                    del merged.entries[name]
            merged.entries[pattern] = style
            for name in list(merged.reasons):
                if merged._matches(pattern, name):
                    merged.reasons[name] = f"user plan entry {pattern!r}: {style}"
        merged.details.update(over.details)
        return merged

    # Data in / out.
    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "mode": self.mode, "prefix": self.prefix,
                "entries": dict(self.entries), "details": self.details, "reasons": self.reasons}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """From `to_dict()` output, or a plain `{pattern: style}` mapping (an HF `tp_plan`)."""
        if isinstance(data, Plan):
            return data
        if "entries" in data and isinstance(data["entries"], Mapping):
            return cls(data["entries"], world_size=data.get("world_size"), mode=data.get("mode", "inference"),
                       details=data.get("details"), reasons=data.get("reasons"), prefix=data.get("prefix"))
        return cls(data)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(Path(path).read_text())

    def compact(self) -> dict[str, str]:
        """Entries with layer numbers folded into `*` where every layer agrees (for display)."""
        import re

        groups: dict[str, set] = {}
        for name, style in self.entries.items():
            groups.setdefault(re.sub(r"\.\d+\.", ".*.", name), set()).add(style)
        out = {}
        for name, style in self.entries.items():
            key = re.sub(r"\.\d+\.", ".*.", name)
            out[key if len(groups[key]) == 1 else name] = style
        return out
