"""The running pipeline: `Pipeline.step` (a training step of every micro-batch) and `Pipeline.eval` (a forward),
on torch's schedule, with the loss the schedule computes on the last stage.

The loss of a step is the mean of its micro-batches' losses (torch divides the gradients by their number), equal to
the batch's mean when every micro-batch has as many labelled tokens; it is broadcast from the last stage to every
rank of the pipeline. Under context parallelism every stage is handed the micro-batch's whole token ids too (as a
keyword argument torch splits into micro-batches and gives every stage), each micro-batch's loss is the token mean
of its whole sequences on every cp rank (`CausalLMLoss`), and `eval`'s logits are gathered to whole sequences.
After the backward, the gradients of a weight tied across the first and last stage are summed (`tied.py`). A send
or receive that fails because a peer died or stopped answering is a `tpkit.CommError`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..comm.errors import CommError
from ..context.pipeline import token_mean
from ..context.sequence import SequenceSplit
from .layout import PipelineGroups
from .parallel import PipelineParallel
from .schedule import V_SHAPED, stage_rank
from .split import StageSplit
from .stage import model_output


class CausalLMLoss:
    """The loss of a Hugging Face causal LM from its logits: the model's own `loss_function` (labels shifted inside;
    under tensor parallelism in training mode, tpkit's vocabulary-parallel one), the mean over the micro-batch's
    tokens, as `model(input_ids=x, labels=x).loss` computes it. Under context parallelism (`cp`, the part's cp
    group) the logits are this rank's tokens: the labels are shifted over the whole sequence and cut, and the ranks'
    shares summed into the whole micro-batch's token mean (`tpkit.context.pipeline.token_mean`)."""

    def __init__(self, part: nn.Module, cp: Communicator | None = None):
        self.part, self.cp = part, cp

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        vocab = self.part.config.vocab_size
        if self.cp is not None and self.cp.world_size > 1:
            return token_mean(self.part.loss_function, logits, labels, vocab, self.cp)
        return self.part.loss_function(logits=logits, labels=labels, vocab_size=vocab)


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
        gradients are those of the mean of the micro-batches' losses. Returns that mean on every rank of the
        pipeline. Every rank passes the same batch, whole sequences (the first and last stage read it; under context
        parallelism every stage, each cutting its rank's tokens). Zero the gradients between steps: torch's
        schedules divide every `.grad` by the micro-batch count at the end of a step, so gradients left from an
        earlier step would be divided again (accumulate with more micro-batches instead)."""
        losses: list[torch.Tensor] = []
        self._run(self.schedule.step, inputs, labels, losses)
        if self.facts.tied is not None:
            self.facts.tied.sum_gradients(self.model)
        return self._mean(losses)

    @torch.no_grad()
    def eval(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor | None:
        """A forward only: with `labels`, the mean loss (on every rank); without, the last stage's output (the
        logits, whole batch, whole sequences) on the ranks running the last stage, None elsewhere. Not under "zbv":
        torch 2.13's ZBV schedule fails a forward without backward (ValueError, before anything runs)."""
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
        if not self.holds_last:
            return None
        out = model_output(out)
        cp = self.groups.cp
        if cp is not None and cp.world_size > 1:  # this rank's tokens of every sequence: the whole sequences
            out = SequenceSplit(inputs.shape[1], cp.world_size).gather(out, cp, 1)
        return out

    def _run(self, run: Callable, inputs, labels, losses):
        args = (inputs,) if self.holds_first else ()
        target = labels if self.holds_last else None
        # under cp every stage cuts the micro-batch's whole token ids itself: torch hands each stage its micro-batch
        # of them (keyword arguments are split as the inputs are and given to every stage)
        kwargs = {"tokens": inputs} if self.groups.cp_size > 1 else {}
        try:
            return run(*args, target=target, losses=losses, **kwargs)
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
