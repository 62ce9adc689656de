"""The vocabulary: LM heads split over the vocabulary (logits gathered for inference, kept split for training),
embeddings split over the vocabulary when they are the vocabulary (or tied to a head), and tied weights split
the same way or not at all.

An LM head is a large linear layer whose output leaves the model (the vocabulary size when the model has a
config, else a vocabulary-like fan-out that weighs something); an embedding that is not the vocabulary (a
position table) stays whole unless it holds at least `LARGE_TABLE` of the parameters: a small one would add an
all-reduce per forward for little memory.
"""
from __future__ import annotations

from typing import Iterator

from torch import nn

from ..family import Choice, Draft, Family, Proposal, whole_choice
from ..modules import is_embedding, is_linear, linear_dims
from ..styles import COLWISE_REP, EMBEDDING_ROWWISE, REPLICATE, SMALL, VOCAB_PARALLEL, VOCAB_STYLES


def lm_heads(a, world_size: int) -> list[str]:
    """The LM heads of an analysed model at this world size (see the module docstring)."""
    t = a.trace
    out = []
    for name in sorted(t.escaped):
        m = a.leaves.get(name)
        if m is None or not is_linear(m) or name in a.structures:
            continue
        n_out = linear_dims(m)[1]
        vocab = getattr(getattr(a.model, "config", None), "vocab_size", None)
        if vocab is not None:
            big = n_out == vocab or name in a.ties
        else:
            # Without a config: a vocabulary-like fan-out (many more outputs than inputs) that weighs something.
            big = name in a.ties or (n_out >= 2 * linear_dims(m)[0] and m.weight.numel() >= 0.05 * a.total_params)
        if n_out >= max(world_size, 2) and big:
            out.append(name)
    return out


LARGE_TABLE = 0.05  # an embedding holding this share of the parameters is split even when not the vocabulary


class Vocabulary(Family):
    name = "vocab"

    def propose(self, draft: Draft, found) -> Iterator[Proposal]:
        a = draft.analysis
        if a.trace is None:
            return
        heads = [h for h in lm_heads(a, draft.world_size) if draft.style(h) is None]  # none kept whole before
        style = VOCAB_PARALLEL if draft.mode == "training" else COLWISE_REP
        for h in heads:
            kept = whole_choice([h], "kept whole by the chosen setup (replicated LM head: no gather of the logits)")
            yield Proposal(self.name, h, (Choice("vocab parallel", {h: style}), kept))
        for name, m in a.leaves.items():
            if draft.style(name) is None and is_embedding(m):
                yield self._embedding(draft, name, m, heads)
        yield from self._ties(draft)

    def _embedding(self, draft: Draft, name: str, m: nn.Module, heads: list[str]) -> Proposal:
        a, world = draft.analysis, draft.world_size
        if name in a.notes:  # a per-head tensor of attention that stays whole
            return Proposal(self.name, name, (Choice("whole", reasons={name: a.notes[name]}),))
        tied_to_head = any(o in heads for o in a.ties.get(name, []))
        vocab = getattr(getattr(a.model, "config", None), "vocab_size", None)
        share = m.weight.numel() / max(a.total_params, 1)
        if m.num_embeddings < world:
            why = f"{m.num_embeddings} rows cannot be split over {world} ranks"
        elif tied_to_head or m.num_embeddings == vocab or share >= LARGE_TABLE:  # a large table, vocabulary or not
            return Proposal(self.name, name, (Choice("vocab parallel", {name: EMBEDDING_ROWWISE}),
                                              whole_choice([name], "kept whole by the chosen setup")))
        else:
            why = (f"not the vocabulary ({share:.1%} of parameters, under {LARGE_TABLE:.0%}; {m.num_embeddings} rows): "
                   f"splitting it would add an all-reduce per forward for little memory{SMALL}")
        return Proposal(self.name, name, (Choice("whole", reasons={name: why}),))

    def _ties(self, draft: Draft) -> Iterator[Proposal]:
        """Tied weights must be split the same way (over the vocabulary) or all stay replicated."""
        for name, others in draft.analysis.ties.items():
            group = [name] + others
            styles = {draft.style(n) or REPLICATE for n in group}
            if styles <= VOCAB_STYLES or styles == {REPLICATE}:
                continue
            yield Proposal(self.name, f"tie:{name}", (Choice("whole", {n: REPLICATE for n in group}, reasons={
                n: f"weight tied with {[o for o in group if o != n]}, which cannot be split the same way"
                for n in group}),))
