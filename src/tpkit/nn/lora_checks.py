"""What a LoRA adapter under tensor parallelism refuses, before any layer changes: shared by the LoRA layers on
tpkit's linear layers (`tpkit.nn.lora`) and on its vocabulary-parallel embedding (`tpkit.nn.lora_embedding`).

Imports nothing from PEFT (the config is read by attribute).
"""
from __future__ import annotations

from typing import Any

#: `init_lora_weights` values that draw the adapter without reading the base weight (the others, PiSSA, OLoRA,
#: LoftQ, EVA, CorDA, ..., decompose the full base weight, which no rank holds).
PLAIN_INITS = (True, False, "gaussian")


DORA_REASON = ("DoRA (use_dora=True) is not supported under tensor parallelism: its magnitude vector divides each "
               "output row by the norm of the merged weight's row, which a row-parallel layer holds split over the "
               "ranks. Use plain LoRA (use_dora=False), or train DoRA on an unconverted model")


class LoraTPError(ValueError):
    """A LoRA configuration or target that tpkit cannot split exactly; raised before any layer changes."""


def check_config(config: Any, where: str) -> None:
    """Refuse, naming the layer and the way out, what cannot run split: DoRA (its magnitude normalises each row of
    the merged weight, which a row-parallel layer holds in pieces), LoRA variants, and inits that read the base."""
    if getattr(config, "use_dora", False):
        raise LoraTPError(f"{where}: {DORA_REASON}")
    init = config.init_lora_weights
    if not any(init is p or init == p for p in PLAIN_INITS):
        raise LoraTPError(f"{where}: init_lora_weights={init!r} decomposes the full base weight, which no rank holds "
                          f"under tensor parallelism; use init_lora_weights=True (or 'gaussian' / False), or "
                          f"initialise on one process, save the adapter, and load it onto the TP model")
    for field in ("use_bdlora", "alora_invocation_tokens", "arrow_config", "velora_config", "monteclora_config",
                  "kasa_config", "mica"):
        if getattr(config, field, None):
            raise LoraTPError(f"{where}: the LoRA variant {field}={getattr(config, field)!r} is not supported under "
                              f"tensor parallelism; use plain LoRA (rsLoRA, use_rslora=True, is supported)")
