"""`tpkit estimate`'s speed table on a measured machine: each world size priced by the setup search's own model
(`predict.predict`: the converter's plan traced op by op, priced with the rates measured on this machine), so
`estimate` and `search` give the same figure for the same setup. The roofline of `speed.py` is for a datasheet
machine (`--hardware`), where there is nothing measured to price ops with.
"""
from __future__ import annotations

import torch

from ..tables import format_bytes
from .predict import Setup, predict
from .pricing import Pricing
from .speed_report import SpeedEstimate, SpeedRow

GOAL = {"training": "train", "decode": "decode", "prefill": "prefill"}


def speed_on_machine(config, world_sizes: list[int], pricing: Pricing, mode: str, batch_size: int, seq_len: int,
                     dtype: torch.dtype | None = None, sequence_parallel: bool = False,
                     recompute: str = "none") -> SpeedEstimate:
    """Time per step (training, prefill) or per token (decode) at each world size, from `predict` with the
    measured profile of `pricing` (see the module doc)."""
    if not pricing.measured:
        raise ValueError("speed_on_machine prices a measured machine; a datasheet is priced by estimate_speed")
    goal = GOAL[mode]
    rows, notes = [], [pricing.origin]
    for t in sorted(set(world_sizes)):
        setup = Setup(t, sequence_parallel=sequence_parallel and t > 1 and goal == "train",
                      recompute=recompute if goal == "train" else "none")
        p = predict(config, setup, goal, batch_size, seq_len, pricing.profile, dtype=dtype)
        units = batch_size if goal == "decode" else batch_size * seq_len
        parts = {"kernels": p.kernels_s, "framework": p.overhead_s,
                 "communication": p.tp_communication_s + p.dp_communication_s}
        rows.append(SpeedRow(t, 0.0, 0.0, 0.0, p.collectives, p.kernels_s, p.overhead_s,
                             p.tp_communication_s + p.dp_communication_s, p.seconds, units / p.seconds, 1.0,
                             max(parts, key=parts.get), p.memory_bytes, p.process_bytes))
    base = rows[0].total_s if rows[0].world_size == 1 else None
    for r in rows:
        r.speedup = base / r.total_s if base else float("nan")
    rates = pricing.profile.rates(1)
    notes.append("a rank's process at its peak (the traced step's tensors + imports + runtime, measured here): "
                 + "; ".join(f"TP {r.world_size}: {format_bytes(r.process_bytes)} ({format_bytes(r.memory_bytes)} + "
                             f"{format_bytes(rates.import_bytes)} + {format_bytes(rates.runtime_bytes)})" for r in rows))
    beyond = [t for t in world_sizes if pricing.beyond(t)]
    if beyond:
        notes.append(f"world sizes {', '.join(map(str, sorted(set(beyond))))} exceed this machine's "
                     f"{pricing.devices} {pricing.device_kind}: priced with the rates measured for the most ranks "
                     f"calibrated, a figure for a larger machine like this one, not a setup to run here")
    name = pricing.profile.hardware.name if pricing.profile.hardware else pricing.profile.name
    dt = str(dtype or torch.float32).replace("torch.", "")
    hw = pricing.profile.hardware
    link = hw.interconnect.name if hw is not None else "its own ranks (measured)"
    return SpeedEstimate(name, link, mode, dt, batch_size, seq_len, rows, notes,
                         parts=("kernels", "framework", "comm"))
