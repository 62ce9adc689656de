"""`tpkit.quant`: quantized checkpoints' formats as data, and their dequantization as tensor ops.

`schemes.py` reads a `quantization_config` into a `Quantization` (per-layer `WeightQuant`, the tensors each layer
stores); `layouts.py` derives each stored tensor's `ShardLayout` from the dense weight's; `packing.py` and
`dequant.py` give a rank's dense weight from its stored slices. Beside `tpkit.layout` at the bottom of the house:
it knows shapes and tensors, nothing of layers, models or files.
"""
from __future__ import annotations

from .dequant import dequantize
from .layouts import positions, stored_layout
from .schemes import (SUPPORTED, DimRule, Quantization, QuantizationError, StoredTensor, WeightQuant,
                      config_quantization, read_quantization, stored_tensors)

__all__ = ["SUPPORTED", "DimRule", "Quantization", "QuantizationError", "StoredTensor", "WeightQuant", "config_quantization", "dequantize",
           "positions", "read_quantization", "stored_layout", "stored_tensors"]
