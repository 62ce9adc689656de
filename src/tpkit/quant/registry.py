"""The quantization formats tpkit reads, by `quant_method`: one line per format family's module.

`read_quantization` reads a model config's `quantization_config` through its format's reader; a `quant_method`,
format or scheme tpkit does not read raises one `QuantizationError` naming it and everything tpkit reads, before any
weight is read. Adding a format = one module (a `format.Format`) + one entry in the line that fills `FORMATS`
(`schemes.FORMATS`, which `WeightQuant.format` reads).
"""
from __future__ import annotations

from typing import Any, Mapping

from . import awq, compressed_tensors, fp8, gptq
from .format import Refused
from .schemes import FORMATS, Quantization, QuantizationError, format_of

FORMATS.update({f.method: f for f in (compressed_tensors.FORMAT, fp8.FORMAT, gptq.FORMAT, awq.FORMAT)})
SUPPORTED = tuple(f.supported for f in FORMATS.values())


def read_quantization(config: Mapping[str, Any] | None) -> Quantization | None:
    """The `Quantization` of a model config's `quantization_config` (None when there is none); raises
    `QuantizationError` for anything tpkit would read wrongly."""
    if not config:
        return None
    qc = dict(config)
    method = qc.get("quant_method")
    fmt = format_of(method)
    try:
        return fmt.read(qc)
    except Refused as r:
        raise QuantizationError(f"quantization_config ({method}): {r.what} is not supported{r.why}; tpkit reads "
                                f"{'; '.join(SUPPORTED)}") from None


def config_quantization(config: Any) -> Quantization | None:
    """The `Quantization` a model config declares (a transformers config, a model's `config`, or a config
    dict), or None: its `quantization_config` as a dict or as transformers' config object."""
    qc = config.get("quantization_config") if isinstance(config, Mapping) else getattr(
        config, "quantization_config", None)
    if qc is not None and not isinstance(qc, Mapping):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else None
    return read_quantization(qc) if qc else None
