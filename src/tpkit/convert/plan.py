"""A tensor-parallel plan as data: `{module name or glob: style}`, printable and JSON in / out.

Style strings are Hugging Face's `tp_plan` vocabulary, with a few of tpkit's own; aliases map to one
canonical style each (`registry.STYLES` holds the whole vocabulary, as style objects). A plan may also carry, per
module, the facts the planner found (`details`: one `Role` each, attention heads, packed pieces) and why a layer
stays replicated (`reasons`), so a saved plan replays exactly and a reader sees what was decided.
"""
from __future__ import annotations

import collections
import difflib
import fnmatch
import json
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from .errors import PlanError
from .registry import STYLES, canonical_style
from .roles import Role
from .styles import ALIASES, ALONE, COLWISE_REP, REPLICATE, SMALL

__all__ = ["Plan", "PlanError", "canonical_style", "check_plan_argument", "is_glob", "PLAN_WORDS", "SMALL", "STYLES",
           "ALIASES"]

#: Reasons of layers kept whole by design (`SMALL` ones, or the setup's or the user's choice), not `kept_whole()`.
_BY_DESIGN = (SMALL.strip(), "kept whole by the chosen setup", "user plan entry ")

#: The words `parallelize(model, plan=...)` takes for a plan it makes itself.
PLAN_WORDS = ("auto",)
ACCEPTED = (f"a word ({', '.join(repr(w) for w in PLAN_WORDS)}: the planner's plan), a path to an existing plan JSON "
            f"file (`Plan.save`, `tpkit analyze --plan-out`), a mapping {{module name or glob: style}} such as "
            f"{{'*.q_proj': 'colwise'}}, or a Plan")


def is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def check_plan_argument(plan: Any, where: str = "parallelize") -> None:
    """Raise `PlanError` (listing what is accepted) for a `plan=` string or path that is neither one of
    `PLAN_WORDS` nor an existing file; anything else is left to the caller."""
    if isinstance(plan, Path) and not plan.is_file():
        raise PlanError(f"{where}: no plan file at {str(plan)!r}. plan= takes {ACCEPTED}")
    if not isinstance(plan, str) or plan in PLAN_WORDS or Path(plan).is_file():
        return
    if plan in STYLES or plan in ALIASES:
        raise PlanError(f"{where}: plan={plan!r} is a style, and a style is given per module: pass a mapping such "
                        f"as {{'*.q_proj': {plan!r}}} (module name or glob -> style), or plan='auto' for the "
                        f"planner's. plan= takes {ACCEPTED}")
    close = difflib.get_close_matches(plan, PLAN_WORDS, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise PlanError(f"{where}: plan={plan!r} is neither a known word nor an existing file; {hint}"
                    f"plan= takes {ACCEPTED}")


class Plan(Mapping[str, str]):
    """`{module name or glob: style}` plus, per module, planner `details` and replicate `reasons`.

    Lookup (`style_for`) takes an exact name over any glob; two globs that both match one module with
    different styles are a conflict (`PlanError`). Patterns may leave out the base model prefix, as HF
    configs' `base_model_tp_plan` do (`layers.*.self_attn.q_proj` matches `model.layers.0.self_attn.q_proj`).
    """

    def __init__(self, entries: Mapping[str, str] | None = None, *, world_size: int | None = None,
                 mode: str = "inference", details: Mapping[str, Role | Mapping] | None = None,
                 reasons: Mapping[str, str] | None = None, prefix: str | None = None,
                 replaced_by_forward: Iterable[str] = ()):
        self.entries: dict[str, str] = {}
        for k, v in dict(entries or {}).items():
            self.entries[str(k)] = canonical_style(v, f"plan entry {k!r}")
        self.world_size = world_size
        self.mode = mode
        self.details: dict[str, Role] = {}
        for k, v in dict(details or {}).items():
            try:
                self.details[str(k)] = Role.from_dict(v)
            except (TypeError, ValueError) as exc:
                raise PlanError(f"plan details of {k!r}: {exc}") from None
        self.reasons = dict(reasons or {})
        self.prefix = prefix
        # modules the model's own forward replaced while this plan was made (BigBird swaps its block-sparse attention
        # for full attention on short inputs): applied as recorded, without that forward, the plan would meet the
        # modules from before (`state.read_request` traces such a model again; the plan cache does not store it)
        self.replaced_by_forward = tuple(replaced_by_forward)

    # Mapping protocol: the entries.
    def __getitem__(self, key: str) -> str:
        return self.entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        kept = f", {self.kept_whole_summary()}" if self.kept_whole() else ""
        alone = f", {self.split_alone_summary()}" if self.split_alone() else ""
        return f"Plan(world_size={self.world_size}, mode={self.mode!r}, entries={self.entries!r}{kept}{alone})"

    def kept_whole(self) -> dict[str, str]:
        """`{module: reason}` for every module that stays whole because something stopped its split (heads
        that do not divide, an untraceable forward, an unknown packing, ...); small layers kept whole by design
        (norms, position tables) and whole layers the setup or the user chose are left out."""
        return {n: r for n, r in self.reasons.items()
                if self.entries.get(n, REPLICATE) == REPLICATE and not any(m in r for m in _BY_DESIGN)}

    def split_alone(self) -> dict[str, str]:
        """`{module: reason}` for every layer the planner could not pair and split on its own instead, its output
        all-gathered on every call (`colwise_rep`; the reason says what stopped the pairing)."""
        return {n: r[:-len(ALONE)] for n, r in self.reasons.items()
                if self.entries.get(n) == COLWISE_REP and r.endswith(ALONE)}

    def kept_whole_summary(self, top: int = 3) -> str:
        """"N modules kept whole: a x reason; b x reason" with the `top` commonest reasons (layer numbers
        folded into `*`, so one reason per layer counts once per kind)."""
        return _summary(self.kept_whole(), "kept whole", top)

    def split_alone_summary(self, top: int = 3) -> str:
        """"N modules split alone (output all-gathered): a x reason; ..." as `kept_whole_summary`."""
        return _summary(self.split_alone(), "split alone (output all-gathered)", top)

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

    def replaced(self, entries: Mapping[str, str] | None = None, details: Mapping[str, Role] | None = None,
                 reasons: Mapping[str, str] | None = None) -> "Plan":
        """A copy with `entries`, `details` or `reasons` given in place of this plan's: entries already canonical
        styles and details `Role` records, as the conversion's steps make them (not checked again: a plan of a
        whole model is copied in every step that changes it)."""
        out = Plan(world_size=self.world_size, mode=self.mode, prefix=self.prefix,
                   replaced_by_forward=self.replaced_by_forward)
        out.entries = dict(self.entries if entries is None else entries)
        out.details = dict(self.details if details is None else details)
        out.reasons = dict(self.reasons if reasons is None else reasons)
        return out

    def updated(self, overrides: Mapping[str, str] | "Plan") -> "Plan":
        """A copy with `overrides` taking precedence: for every module an override names, the override's
        style wins over this plan's entry (user entries over auto ones)."""
        over = overrides if isinstance(overrides, Plan) else Plan(overrides)
        merged = Plan(self.entries, world_size=self.world_size, mode=self.mode, details=self.details,
                      reasons=self.reasons, prefix=self.prefix, replaced_by_forward=self.replaced_by_forward)
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
        out = {"world_size": self.world_size, "mode": self.mode, "prefix": self.prefix,
               "entries": dict(self.entries), "details": {k: v.to_dict() for k, v in self.details.items()},
               "reasons": self.reasons}
        if self.replaced_by_forward:
            out["replaced_by_forward"] = list(self.replaced_by_forward)
        return out

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
                       details=data.get("details"), reasons=data.get("reasons"), prefix=data.get("prefix"),
                       replaced_by_forward=data.get("replaced_by_forward") or ())
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


def _summary(by_module: Mapping[str, str], what: str, top: int) -> str:
    """"N modules <what>: a x reason; b x reason" with the `top` commonest reasons (layer numbers folded into `*`)."""
    counts = collections.Counter(re.sub(r"\.\d+(?=[.:\s']|$)", ".*", r) for r in by_module.values())
    shown = "; ".join(f"{n} x {r}" for r, n in counts.most_common(top))
    more = f"; {len(counts) - top} other reasons" if len(counts) > top else ""
    return f"{len(by_module)} module{'s' * (len(by_module) != 1)} {what}: {shown}{more}"
