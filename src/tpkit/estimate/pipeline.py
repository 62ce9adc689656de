"""A pipeline-parallel setup priced from the same setup without the pipeline: its bubble and its stage sends.

`tpkit.pipeline` cuts the model into p stages (balanced: each holds about 1/p of the layers' work) and runs m
micro-batches per step through torch's schedule, v stages per rank. With the step of the whole model at the same
tp x dp priced op by op (`predict`) at one micro-batch's size, a slot is a (v-th of a) stage's share of it, 1/(p v):
every op runs once per micro-batch, paying its fixed cost each time, and a micro-batch's few rows run the matmuls
at their own (lower) rate. (Priced as 1/m of the whole batch's step instead, a GPT-2 h256 x 4 step at batch 8 x 32,
pp2 m8 on the 2-core box, was predicted 70 ms and ran 146 ms, and the search picked it over tp2, which ran 65-69 ms.)
The schedule runs v m + p - 1 slots, of which p - 1 idle (`bubble_fraction`), and every slot sends its activation
forward and its gradient back: 2 point-to-point messages of `activation_bytes` per slot, priced by the calibrated
2-rank all-gather (it moves each rank's bytes to the other once: the measured figure nearest a send; tpkit calibrates
no send of its own). Data parallelism's collectives run once per step on the stage's 1/p of the parameters.

Memory: a stage holds 1/p of the weights, gradients and optimizer states, and the activations of its layers for
the micro-batches in flight: all m under GPipe, at most p (of the m, each 1/m of the batch) under 1F1B and the
interleaved schedules.
"""
from __future__ import annotations

import dataclasses

from .machine import MachineRates

SCHEDULES_IN_FLIGHT_ALL = ("gpipe",)  # schedules that keep every micro-batch's activations until the backward


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle fraction of a step, (p - 1) / (v m + p - 1) for p ranks, m micro-batches and v stages per rank
    (GPipe and 1F1B: v = 1; interleaving divides the warm-up and cool-down by v)."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def send_seconds(rates: MachineRates, nbytes: float) -> float:
    """One point-to-point message of `nbytes` (see the module docstring)."""
    return rates.collective("all_gather", 2).seconds(nbytes) if nbytes > 0 else 0.0


def pipelined(base, setup, rates: MachineRates, activation_bytes: float, micro=None):
    """`base` (the `Prediction` of the setup without pipelining, at the same tp x dp and batch) as `setup` (with
    `pp`, `microbatches`, `stages_per_rank`, `schedule`) runs it: a `Prediction`. `micro`: the same without
    pipelining at one micro-batch's size, which prices the slots (default: `base` over m, as if every cost shrank
    with the batch)."""
    p, m, v = setup.pp, setup.microbatches, setup.stages_per_rank
    unit = micro if micro is not None else dataclasses.replace(
        base, kernels_s=base.kernels_s / m, overhead_s=base.overhead_s / m,
        tp_communication_s=base.tp_communication_s / m, cp_communication_s=base.cp_communication_s / m)
    slots = v * m + p - 1
    per_slot = (unit.kernels_s + unit.overhead_s + unit.tp_communication_s + unit.cp_communication_s) / (p * v)
    stage = per_slot * v * m  # a stage's busy time in a step
    sends = 2 * slots * send_seconds(rates, activation_bytes / m)
    seconds = slots * per_slot + sends + base.dp_communication_s / p
    in_flight = 1.0 if setup.schedule in SCHEDULES_IN_FLIGHT_ALL else min(p, m) / m
    weights = base.memory_bytes - base.activation_bytes
    memory = weights / p + base.activation_bytes / p * in_flight
    return dataclasses.replace(base, setup=setup, seconds=seconds, kernels_s=unit.kernels_s * m / p,
                               overhead_s=unit.overhead_s * m / p, tp_communication_s=unit.tp_communication_s * m / p,
                               dp_communication_s=base.dp_communication_s / p,
                               cp_communication_s=unit.cp_communication_s * m / p, memory_bytes=memory,
                               process_bytes=base.process_bytes - base.memory_bytes + memory,
                               bubble_s=slots * per_slot - stage, pp_communication_s=sends)
