"""`tpkit.pipeline`: a model cut into stages on torch's pipeline engine, each stage tensor- and data-parallel.

    pipe = tpkit.pipeline(model, comm, pp=2, tp=2, schedule="1f1b", microbatches=4)
    opt = torch.optim.AdamW(pipe.model.parameters())
    loss = pipe.step(input_ids, labels)            # forward and backward of every micro-batch
    norm = tpkit.clip_grad_norm_(pipe.model.parameters(), 1.0)
    opt.step(); opt.zero_grad()

In order, before anything runs: the split (`split.py`), the ties across the first and last stage (`tied.py`), the
groups (`layout.py`: world = pp x dp x tp, tp innermost), the whole model's tensor-parallel plan (`compose.py`),
then the model is cut to this rank's part (`stage.py`), converted on the tp group, its stage modules put under
FSDP2 or DDP over the dp group, and handed to torch's `PipelineStage` and schedule (`schedule.py`).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..comm.errors import CommError
from ..nn._layer import resolve_comm
from ..nn.record import find_record
from .compose import convert_part, converted_plan, data_parallel_stages
from .layout import PipelineGroups, pipeline_groups
from .parallel import PipelineParallel
from .schedule import V_SHAPED, check_schedule, make_schedule, rank_stages, stage_rank
from .split import StageSplit, split_stages
from .stage import StageModule, model_output, prune, stage_modules
from .tied import TiedCopies, tied_groups, tied_pairs, untie


class CausalLMLoss:
    """The loss of a Hugging Face causal LM from its logits: the model's own `loss_function` (labels shifted inside;
    under tensor parallelism in training mode, tpkit's vocabulary-parallel one), the mean over the micro-batch's
    tokens, as `model(input_ids=x, labels=x).loss` computes it."""

    def __init__(self, part: nn.Module):
        self.part = part

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.part.loss_function(logits=logits, labels=labels, vocab_size=self.part.config.vocab_size)


class SwitchedLoss:
    """The schedule's loss function, switched off for a forward without labels (torch's schedules compute a loss on
    the last stage whenever they hold a loss function; they are then given the inputs as stand-in targets)."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.loss_fn, self.enabled = loss_fn, True

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) if self.enabled else output.new_zeros(())


class Pipeline:
    """This rank's view of a pipeline: `model` (its part: the parameters, state dict, checkpoints and
    `tpkit.clip_grad_norm_` of the whole model's keys it holds), `stages` (the modules torch runs), `schedule`
    (torch's), `groups`, `split`."""

    def __init__(self, model: nn.Module, stages: list[nn.Module], schedule: Any, facts: PipelineParallel,
                 microbatches: int, loss: SwitchedLoss):
        self.model, self.stages, self.schedule, self.facts, self.loss = model, stages, schedule, facts, loss
        self.microbatches = microbatches
        self.last_rank = stage_rank(facts.split.num_stages - 1, facts.split.num_stages, facts.pp_size,
                                    facts.schedule)

    @property
    def groups(self) -> PipelineGroups:
        return self.facts.groups

    @property
    def split(self) -> StageSplit:
        return self.facts.split

    @property
    def holds_first(self) -> bool:
        return 0 in self.facts.stages

    @property
    def holds_last(self) -> bool:
        return self.facts.split.num_stages - 1 in self.facts.stages

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the batch `inputs` in `microbatches` micro-batches (split along dim 0); the
        gradients are those of the mean of the micro-batches' losses, accumulated into `.grad`. Returns that mean
        on every rank of the pipeline. Every rank passes the same batch (only the first and last stage read it)."""
        losses: list[torch.Tensor] = []
        self._run(self.schedule.step, inputs, labels, losses)
        if self.facts.tied is not None:
            self.facts.tied.sum_gradients(self.model)
        return self._mean(losses)

    @torch.no_grad()
    def eval(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor | None:
        """A forward only: with `labels`, the mean loss (on every rank); without, the last stage's output (the
        logits, whole batch) on the ranks running the last stage, None elsewhere. Not under "zbv": torch 2.13's
        ZBV schedule fails a forward without backward (ValueError, before anything runs)."""
        if self.facts.schedule in V_SHAPED:
            raise ValueError(f"Pipeline.eval: torch's {self.facts.schedule!r} schedule cannot run a forward without "
                             f"its backward; evaluate under another schedule (the checkpoint loads at any)")
        losses: list[torch.Tensor] = []
        self.loss.enabled = labels is not None
        try:
            out = self._run(self.schedule.eval, inputs, labels if labels is not None else inputs, losses)
        finally:
            self.loss.enabled = True
        if labels is not None:
            return self._mean(losses)
        return model_output(out) if self.holds_last else None

    def _run(self, run: Callable, inputs, labels, losses):
        args = (inputs,) if self.holds_first else ()
        target = labels if self.holds_last else None
        try:
            return run(*args, target=target, losses=losses)
        except Exception as exc:
            failure = _comm_failure(exc)
            if failure is None:
                raise
            raise CommError(f"pipeline: a stage's send or receive failed on pipeline rank {self.groups.pp_rank} "
                            f"({failure}); a peer died or stopped answering") from exc

    def _mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        mine = torch.stack([x.detach().to(torch.float64) for x in losses]).mean() if self.holds_last \
            else torch.zeros((), dtype=torch.float64)
        return self.groups.pp.broadcast(mine.cpu(), src=self.last_rank)


def _comm_failure(exc: BaseException) -> str | None:
    """What in `exc`'s chain says a communication failed (torch.distributed's errors, a dead connection), or None."""
    import torch.distributed as dist

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (CommError, dist.DistError)) or any(
                w in str(seen) for w in ("Connection closed", "Connection reset", "Timed out", "timed out",
                                         "Broken pipe", "ECONNRESET")):
            return f"{type(seen).__name__}: {str(seen).splitlines()[0] if str(seen) else ''}"
        seen = seen.__cause__ or seen.__context__
    return None


def pipeline(model: nn.Module, comm: Communicator | None = None, *, pp: int, tp: int = 1, schedule: str = "1f1b",
             microbatches: int | None = None, stages_per_rank: int | None = None, starts: Sequence[int] | None = None,
             dp_mode: str = "fsdp", mode: str = "training",
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> Pipeline:
    """Cut `model` (in place) into `pp x stages_per_rank` stages over the world `comm` (default
    `tpkit.get_communicator()`, a torch backend) laid out as pp x dp x tp (`tpkit.pipeline_groups`), and return
    this rank's `Pipeline`. `model.parameters()` are this rank's afterwards (also `Pipeline.model`).

    `schedule`: "gpipe", "1f1b" (one stage per rank), "interleaved1f1b", "looped_bfs", "interleaved_zb" (several;
    default 2), "zbv" (two). `microbatches` (default pp x stages_per_rank) must divide the batch. `starts`: the
    first block of each stage (default: balanced by cost and memory, `tpkit.split_stages`). `dp_mode`: FSDP2 or
    DDP over dp = world / (pp x tp). `mode`: as `parallelize`'s ("training": the LM head's logits stay split over
    the vocabulary and the loss is computed on them). `loss_fn(output, labels)`: default, a Hugging Face causal
    LM's own loss. Raises before anything changes when the model cannot be cut as asked."""
    comm = resolve_comm(comm)
    if getattr(comm, "process_group", None) is None:
        raise TypeError(f"pipeline: comm must be a torch-backend communicator (tpkit.init()); got "
                        f"{type(comm).__name__}: torch's pipeline stages send over torch.distributed")
    v = stages_per_rank if stages_per_rank is not None else (1 if schedule in ("gpipe", "1f1b") else 2)
    check_schedule(schedule, v)
    if find_record(model, "pipeline") is not None:
        raise ValueError("pipeline: the model is converted already; pass the original model (each stage is "
                         "converted on its tensor-parallel group)")
    split = split_stages(model, pp * v, starts)
    pairs = tied_pairs(model, split)
    m = microbatches if microbatches is not None else pp * v
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"pipeline: microbatches must be a positive int, got {microbatches!r}")
    groups = pipeline_groups(comm, pp, tp)
    n = split.num_stages
    mine = rank_stages(groups.pp_rank, n, pp, schedule)
    first, last = stage_rank(0, n, pp, schedule), stage_rank(n - 1, n, pp, schedule)
    tied_comm = tied_groups(comm, pairs, first, last, groups.pp_rank, groups.dp.world_size, tp)
    keys = frozenset(model.state_dict().keys())
    plan = converted_plan(model, groups.tp, mode) if tp > 1 else None
    if pairs and first == last == groups.pp_rank:
        untie(model, pairs)
    prune(model, split, mine)
    record = convert_part(model, plan, groups.tp, mode)
    tied = _tied(pairs, tied_comm, groups.pp_rank, first, last)
    facts = PipelineParallel(groups, split, tuple(mine), schedule, tied, keys, record)
    record.pipeline = facts
    return _run_stages(model, facts, groups, m, dp_mode, loss_fn)


def _tied(pairs, comm, pp_rank: int, first: int, last: int) -> TiedCopies | None:
    """This rank's side of the tied pairs, or None when it holds neither."""
    if not pairs or pp_rank not in (first, last):
        return None
    role = "both" if first == last else "first" if pp_rank == first else "last"
    return TiedCopies(tuple(pairs), role, comm)


def _run_stages(part: nn.Module, facts: PipelineParallel, groups: PipelineGroups, microbatches: int, dp_mode: str,
                loss_fn) -> Pipeline:
    """torch's `PipelineStage`s and schedule over the part's stage modules (under data parallelism when dp > 1)."""
    from torch.distributed.pipelining import PipelineStage

    modules: list[nn.Module] = list(stage_modules(part, facts.split, list(facts.stages)))
    views: list[StageModule] = list(modules)  # type: ignore[arg-type]
    if groups.dp.world_size > 1:
        modules = data_parallel_stages(part, views, facts.split, groups.dp, dp_mode, facts.record)
    device = next(part.parameters()).device
    n = facts.split.num_stages
    stages = [PipelineStage(mod, s, n, device, group=groups.pp.process_group)
              for mod, s in zip(modules, facts.stages)]
    loss = SwitchedLoss(loss_fn if loss_fn is not None else CausalLMLoss(part))
    schedule = make_schedule(facts.schedule, stages, microbatches, loss)
    return Pipeline(part, views, schedule, facts, microbatches, loss)
