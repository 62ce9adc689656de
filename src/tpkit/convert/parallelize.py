"""`parallelize(model, plan, comm)`: swap a model's layers for this rank's `tpkit.nn` shards, in place.

`parallelize` reads as its steps, each a function taking and returning one `state.ConversionState`:

 0. unwrap        `peft.adapters.without_adapters`: a PEFT model's bare model, its adapters carried aside
    begin         `state.begin`: the `plan=` argument read once (`state.Request`); what cannot be converted refused
 1. trace         `planning.decide.trace_model`: the model's trace, or its cut to distinct blocks', or none (recorded)
 2. plan          `planning.decide.make_plan`: the planner's plan and the user's entries, resolved once
 3. dry run       `planning.decide.dry_run_plan`: the converted forward once on a copy; what fails is kept whole
 4. dataflow      `planning.decide.check_dataflow`: on a cut, the plan's dataflow checks there
 5. expand        `planning.decide.expand_plan`: on a cut, the plan given to every block
 6. quantization  `steps.quantization_units`: quantized column / row pairs split in whole groups
 7. lay out       `steps.lay_out`: every tensor's layout on this rank, the plan checked as a whole
 8. build, swap   `steps.build_and_swap`: every new layer built, then swapped in (the first change)
 9. record        `steps.record`: the `Conversion` record attached; what stock tools call answered (`stock_calls`)
10. re-wrap       `peft.adapters.rewrap_adapters`: the adapters around their new base layers
11. gradients     `layouts.check_gradients`: every gradient that must be summed over ranks is (checked once)

A concern that applies to some models (PEFT, quantization, repeated blocks, a recorded plan) is decided in one
step and passes the state through untouched elsewhere. Every step runs once per conversion (`state.steps_once`;
a second entry raises `StepReentered`). Everything is checked and every new layer is built before the first module
is swapped, so an error leaves the model exactly as it was. Later concerns apply after conversion, each its own
call (`tpkit.context_parallel`, data parallelism), reading the record.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..nn._layer import resolve_comm
from ..quant import Quantization
from .layouts import check_gradients
from .peft.adapters import rewrap_adapters, without_adapters
from .planning.decide import check_dataflow, dry_run_plan, expand_plan, make_plan, trace_model
from .quantized import QuantizedLayers
from .state import begin, steps_once
from .steps import build_and_swap, lay_out, quantization_units, record


def parallelize(model: nn.Module, plan: Any = "auto", comm=None, *, mode: str = "inference",
                example_inputs: Any = None, sequence_parallel: bool = False, recorded: bool = False,
                reuse: bool | None = None, quantization: Quantization | QuantizedLayers | None = None) -> nn.Module:
    """Convert `model` in place to this rank's tensor-parallel shard and return it.

    `plan`: "auto" (the planner's), a `Plan` (applied as is), a path to a plan JSON, or a mapping of user
    entries `{module name or glob: style}` that override the automatic plan. `comm`: the tensor-parallel
    communicator (default `tpkit.get_communicator()`). `mode="training"` keeps LM-head logits split over
    the vocabulary (use `tpkit.nn.vocab_parallel_cross_entropy`). Works on meta-device models (shards
    stay meta, to be loaded later). Raises before changing anything when the plan cannot be applied. Before any
    weight changes, the converted structure runs once on meta tensors (a real copy for a small model whose forward
    needs values) with the example inputs: a block that fails there stays whole, with the error as its reason in
    `model.tp_plan`; a plan the user wrote that fails there is a PlanError.

    `sequence_parallel=True` (or plan entries styled "sequence_parallel") also splits the residual stream
    along the sequence between row- and column-wise layers (see `sequence.py`; training mode, sequence length
    a multiple of the world size; the norms' partial gradients are summed in the backward).

    `recorded=True`: `plan` is the `Plan` this same model was converted with before at this world size (as a
    checkpoint records it); it is applied without tracing the model or re-checking the dataflow, which was
    done when it was made (reloads skip the trace). Ignored with sequence parallelism, which needs the trace, and
    for a plan made while the model's forward replaced some of its modules (`Plan.replaced_by_forward`: BigBird's
    attention), which the trace replaces again.

    A model holding PEFT LoRA adapters (a `PeftModel`, or layers PEFT wrapped) converts as the bare model would,
    each adapter following its base layer's split (`tpkit.nn.lora`): the model `peft.get_peft_model` gives on the
    converted model.

    `reuse` (default on; `TPKIT_PLAN_REUSE=0` turns it off), as for `tpkit.plan`: with "auto" or a mapping of
    overrides, a model whose blocks repeat is traced and dry-run cut to its distinct blocks and the plan expanded
    to the others; the result equals the whole trace's (which is made instead wherever that is unsure, and always
    with sequence parallelism).

    `quantization`: a checkpoint's `QuantizedLayers` (`from_pretrained` passes it), whose layers are built holding
    the stored tensors, empty for a load to fill (`quantized.py`); or a bare `Quantization` (layers stay dense).
    Either way column / row pairs split in whole quantization groups where they can.
    """
    with steps_once(), without_adapters(model) as (bare, adapters):                        # 0. unwrap
        s = begin(bare, plan, resolve_comm(comm), adapters, mode=mode, example_inputs=example_inputs,
                  sequence_parallel=sequence_parallel, recorded=recorded, reuse=reuse, quantization=quantization)
        s = trace_model(s)                                                                  # 1. trace
        s = make_plan(s)                                                                    # 2. plan
        s = dry_run_plan(s)                                                                 # 3. dry run
        s = check_dataflow(s)                                                               # 4. dataflow
        s = expand_plan(s)                                                                  # 5. expand
        s = quantization_units(s)                                                           # 6. quantization
        s = lay_out(s)                                                                      # 7. lay out
        s = build_and_swap(s)                                                               # 8. build, swap
        conversion = record(s)                                                              # 9. record
        rewrap_adapters(bare, adapters, conversion)                                         # 10. re-wrap
        check_gradients(bare, "parallelize", conversion)                                    # 11. gradients
    return model

