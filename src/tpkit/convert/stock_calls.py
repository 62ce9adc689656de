"""What stock tools call on a converted model, answered for the whole model: the last step of `parallelize`.

A converted model is still the user's model object, and tools written for one process call it: transformers'
`save_pretrained` and `num_parameters`, a metric reading `outputs.logits`, `output_attentions=True`,
`resize_token_embeddings`. Each would see this rank's slices. `install(model)` makes each give the one-process
answer or refuse naming tpkit's way, through the extension points those tools have:

- the model's outputs (a forward hook): a vocabulary-parallel head's logits read as the full logits
  (`tpkit.nn.SplitLogits`, gathered on first use), attention weights of every head in global order (gathered when
  the model returns them);
- transformers' save hooks (`gather_sharded_state_dict_for_save`, `should_save_on_this_rank`,
  `barrier_after_gathered_checkpoint_save`, methods `save_pretrained` calls on the model): `save_pretrained`,
  called on every rank, gathers each full tensor and world rank 0 writes the directory one process writes;
- `num_parameters()`: the whole model's count; `resize_token_embeddings`: refused, naming the way;
- the forward sentinel (`tpkit.nn.sentinel`): the misuse stock training tools bring, caught at the forward.

Each is an attribute or hook on the model instance holding the model's record (the record refers to the model
weakly), so it follows the model through `deepcopy` and pickling.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..comm.rebind import root_of
from ..layout import HeadLayout
from ..nn import sentinel
from ..nn.full_tensors import full_numel, full_state_dict, is_embedding
from ..nn.mappings import gather_from_region
from ..nn.record import ModelRecord
from ..nn.split_logits import SplitLogits
from .conversion import Conversion, conversions_in
from .styles import ROWWISE, VOCAB_PARALLEL

SAVE_HOOKS = ("gather_sharded_state_dict_for_save", "should_save_on_this_rank",
              "barrier_after_gathered_checkpoint_save")


def install(model: nn.Module, record: Conversion, modules: Mapping[str, nn.Module] | None = None) -> None:
    """Everything of the module docstring, on a converted `model` whose record is `record` (`modules`: its modules
    by name, when the caller walked them)."""
    if record.world_size == 1:
        return
    modules = dict(model.named_modules()) if modules is None else modules
    sentinel.install(model, record)
    heads = _attention_heads(list(modules), record)
    head = _vocab_head(record)
    vocab = _head_sizes(modules.get(head)) if head is not None else None
    if heads or vocab is not None:
        model.register_forward_hook(FullOutputs(record, vocab, heads))
    if install_whole_model_calls(model, record):
        model.resize_token_embeddings = RefuseResize(record)


def install_whole_model_calls(model: nn.Module, record: ModelRecord) -> bool:
    """transformers' save hooks and `num_parameters` of the whole model (the second item of the module docstring) on
    a transformers `model` whose record is `record`; returns whether `model` is one (no other model has these calls).
    `install` calls it; so does `tpkit.expert_parallel`, whose experts are split over the expert group whatever the
    tensor-parallel size (1 included, where `install` did nothing)."""
    if not any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(model).__mro__):
        return False
    if all(hasattr(type(model), h) for h in SAVE_HOOKS):
        model.gather_sharded_state_dict_for_save = GatherForSave(record)
        model.should_save_on_this_rank = SaveOnWorldRankZero(record)
        model.barrier_after_gathered_checkpoint_save = WorldBarrier(record)
    model.num_parameters = NumParameters(record)
    return True


def world_of(record: ModelRecord):
    """The world communicator of a record's groups: its tensor-parallel group's, or its expert group's (a model
    expert-parallel on a tp size of 1 holds no tensor-parallel group)."""
    return root_of(record.comm if record.comm is not None or record.experts is None else record.experts.ep)


class FullOutputs:
    """Forward hook: `outputs.logits` of a vocabulary-parallel head as `SplitLogits` (`vocab`: every rank's width),
    and every tensor of `outputs.attentions` gathered over the heads (`heads[i]`: layer i's query heads, rank after
    rank, in global numbers)."""

    def __init__(self, record: Conversion, vocab: tuple[int, ...] | None, heads: list[tuple[tuple[int, ...], ...]]):
        self.record, self.vocab, self.heads = record, vocab, heads

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if sentinel.not_eager() or self.record.pipeline is not None:
            return None  # a pipeline stage's outputs go to its schedule, which knows the split
        if isinstance(output, tuple):  # return_dict=False: (loss,) + (logits, ...), as transformers builds it
            at = 1 if output and isinstance(output[0], torch.Tensor) and output[0].dim() == 0 else 0
            logits = self._whole(output[at] if at < len(output) else None)
            return output if logits is None else output[:at] + (logits,) + output[at + 1:]
        if not hasattr(output, "keys"):
            return None
        logits = self._whole(output.get("logits"))
        if logits is not None:
            output["logits"] = logits
        for field in ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions"):
            found = output.get(field)
            if isinstance(found, (tuple, list)) and self.heads:
                output[field] = type(found)(self._gather_heads(field, i, t, len(found)) for i, t in enumerate(found))
        return output

    def _whole(self, logits: Any) -> SplitLogits | None:
        """`logits` (this rank's vocabulary slice) read as the full logits, or None when it is no such slice."""
        if self.vocab is None or not isinstance(logits, torch.Tensor) or isinstance(logits, SplitLogits) or \
                logits.dim() < 1 or logits.shape[-1] != self.vocab[self.record.comm.rank]:
            return None
        return SplitLogits.wrap(logits, self.record.comm, self.vocab)

    def _gather_heads(self, field: str, i: int, t: Any, layers: int) -> Any:
        """Layer `i` (of `layers`)'s attention weights `(batch, local heads, ...)` with every rank's heads, in global
        order."""
        if not isinstance(t, torch.Tensor):
            return t
        comm = self.record.comm
        if len(set(self.heads)) == 1:
            heads = self.heads[0]
        elif field == "attentions" and layers == len(self.heads):
            heads = self.heads[i]
        else:
            raise NotImplementedError(f"tpkit: {field} of a model whose attention layers split their heads "
                                      f"differently cannot be put back in order; run output_attentions on the "
                                      f"unconverted model")
        sizes = [len(h) for h in heads]
        if t.dim() < 2 or t.shape[1] != sizes[comm.rank]:
            raise ValueError(f"tpkit: {field}[{i}] has shape {tuple(t.shape)}; this rank holds {sizes[comm.rank]} of "
                             f"the layer's {sum(sizes)} heads, expected in dim 1. tpkit cannot put these weights back "
                             f"in head order")
        gathered = gather_from_region(t, comm, 1, sizes)
        order = [h for rank in heads for h in rank]
        if order == sorted(order):
            return gathered
        return gathered.index_select(1, torch.tensor(sorted(range(len(order)), key=order.__getitem__),
                                                     device=gathered.device))


class GatherForSave:
    """transformers' `gather_sharded_state_dict_for_save`: every full tensor of the state dict `save_pretrained`
    writes, gathered (collective); the ranks that write nothing get {}."""

    def __init__(self, record: Conversion):
        self.record = record

    def __call__(self, model_to_save: nn.Module, state_dict: dict, distributed_config: Any = None, *,
                 save_on_this_rank: bool = True) -> dict:
        return full_state_dict(self.record, state_dict, keep=save_on_this_rank)


class SaveOnWorldRankZero:
    """transformers' `should_save_on_this_rank`: the first rank of the world writes (threads and MPI ranks too, which
    transformers cannot tell apart)."""

    def __init__(self, record: Conversion):
        self.record = record

    def __call__(self, is_main_process: bool = True) -> bool:
        return bool(is_main_process) and world_of(self.record).rank == 0


class WorldBarrier:
    """transformers' `barrier_after_gathered_checkpoint_save`: no rank returns before the files are written."""

    def __init__(self, record: Conversion):
        self.record = record

    def __call__(self, distributed_config: Any = None) -> None:
        world_of(self.record).barrier()


class NumParameters:
    """transformers' `num_parameters(only_trainable, exclude_embeddings)`: the whole model's count."""

    def __init__(self, record: Conversion):
        self.record = record

    def __call__(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        model = self.record.owner
        skip = {f"{n}.weight" for n, m in model.named_modules() if is_embedding(m)} if exclude_embeddings else set()
        return sum(full_numel(self.record, k, p) for k, p in model.named_parameters()
                   if k not in skip and (p.requires_grad or not only_trainable))


class RefuseResize:
    """transformers' `resize_token_embeddings`, refused: the embedding and the head are split."""

    def __init__(self, record: Conversion):
        self.record = record

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"resize_token_embeddings on a tensor-parallel model: its embedding and LM head are split over "
            f"{self.record.world_size} ranks. Resize the unconverted model (model.resize_token_embeddings(n), then "
            f"tpkit.parallelize), or save the resized model (save_pretrained) and load it with tpkit.from_pretrained")


def vocabulary_sizes(model: nn.Module) -> tuple[int, ...] | None:
    """Every rank's width of the logits a converted `model` (or a wrapper of it) returns split over the vocabulary;
    None when it returns whole logits."""
    found = conversions_in(model)
    if len(found) != 1:
        return None
    name, record = found[0]
    head = _vocab_head(record)
    return _head_sizes(model.get_submodule(f"{name}.{head}" if name else head)) if head is not None else None


def _vocab_head(record: Conversion) -> str | None:
    """The name of the one head a converted model's plan splits over the vocabulary, or None."""
    heads = [n for n, s in record.plan.entries.items() if s == VOCAB_PARALLEL]
    return heads[0] if len(heads) == 1 and record.world_size > 1 else None


def _head_sizes(head: nn.Module | None) -> tuple[int, ...] | None:
    """Every rank's width of the logits of a vocabulary-parallel `head`."""
    sizes = getattr(head, "partition_sizes", None)
    return tuple(int(s) for s in sizes) if sizes is not None else None


def _attention_heads(names: list[str], record: Conversion) -> list[tuple[tuple[int, ...], ...]]:
    """Per attention block split by heads, in the model's module order (`names`: its modules'): each rank's query
    heads (global numbers)."""
    order = {n: i for i, n in enumerate(names)}
    found = []
    for name, style in record.plan.entries.items():
        d = record.plan.details.get(name)
        if style == ROWWISE and d is not None and d.is_attention:
            lay: HeadLayout = d.heads(record.world_size)
            found.append((order.get(d.attention or "", 0), tuple(tuple(h) for h in lay.q_heads)))
    return [heads for _, heads in sorted(found)]
