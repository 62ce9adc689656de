"""`tpkit.quant`: quantized checkpoints' formats as data, and their dequantization and products as tensor ops.

One module per format family (`compressed_tensors.py`, `fp8.py`, `gptq.py`, `awq.py`), each a `format.Format`: its
config reader, the tensors a layer stores, how they dequantize and its fast product; `registry.py` holds them by
`quant_method` and reads a `quantization_config` (`read_quantization`). The shared pieces: `schemes.py` (what a
layer stores: `WeightQuant`, `StoredTensor`, `DimRule`; a checkpoint's `Quantization`; `QuantizationError`),
`layouts.py` (each stored tensor's `ShardLayout` from the dense weight's), `held.py` (what a layer holds on a rank
once loaded, and the bytes it keeps beside its stored tensors), `packing.py` and `dequant.py` (a rank's dense weight
from its stored slices), `kernels.py` (torch's weight-only kernels fed from the stored words). Beside
`tpkit.layout` at the bottom of the house: it knows shapes and tensors, nothing of layers, models or files (the
layer that holds the stored tensors is `tpkit.nn.quantized`).
"""
from __future__ import annotations

from .dequant import dequantize
from .held import LayerTensors, layer_tensors, resident_bytes
from .layouts import positions, stored_layout
from .registry import SUPPORTED, config_quantization, read_quantization
from .schemes import (DimRule, Quantization, QuantizationError, StoredTensor, WeightQuant, format_of,
                      stored_tensors)

__all__ = ["SUPPORTED", "DimRule", "LayerTensors", "Quantization", "QuantizationError", "StoredTensor", "WeightQuant",
           "config_quantization", "dequantize", "format_of", "layer_tensors", "positions", "read_quantization",
           "resident_bytes", "stored_layout", "stored_tensors"]
