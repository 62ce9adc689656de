"""Hugging Face FP8 checkpoints with block scales (DeepSeek-V3, Qwen3-FP8): `quant_method: fp8`.

Each quantized linear layer stores its `weight` as FP8 (e4m3) values and one `weight_scale_inv` per block of
`weight_block_size` (e.g. 128 x 128; the last block of a dim may be partial). `w = q * s` in float32, then cast
to the compute dtype, as transformers' `Fp8Dequantize` does; decode multiplies by the FP8 values in place
(`products.Native`). `modules_to_not_convert` stay dense. Per-tensor FP8
(no `weight_block_size`) is refused: tpkit reads the block-scaled format.
"""
from __future__ import annotations

import torch

from .format import Format, Product, Refused
from .products import Native, native_applies
from .schemes import DimRule, Quantization, StoredTensor, WeightQuant, groups

METHOD = "fp8"


class HuggingFaceFP8(Format):
    method = METHOD
    supported = "fp8 (block scales, weight_scale_inv)"

    def read(self, qc: dict) -> Quantization:
        block = qc.get("weight_block_size")
        if not block or len(block) != 2:
            raise Refused(f"weight_block_size {block!r}", " (tpkit reads block-scaled FP8: weight_scale_inv)")
        scheme = WeightQuant(METHOD, "float", 8, True, "block", block=(int(block[0]), int(block[1])),
                             scale_name="weight_scale_inv")
        return Quantization(METHOD, qc, ((("Linear",), scheme),), tuple(qc.get("modules_to_not_convert") or ()))

    def stored_tensors(self, q: WeightQuant, out: int, in_: int) -> list[StoredTensor]:
        bh, bw = q.block
        return [StoredTensor("weight", (out, in_), torch.float8_e4m3fn, (DimRule(0), DimRule(1))),
                StoredTensor(q.scale_name, (groups(out, bh), groups(in_, bw)), None,
                             (DimRule(0, 1, bh), DimRule(1, 1, bw)))]

    def math_dtype(self, q: WeightQuant, scale_dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def products(self, q: WeightQuant, local_shape: tuple[int, int], mapped: bool, dtype: torch.dtype,
                 scale_dtype: torch.dtype | None) -> list[Product]:
        """tpkit's compiled product on the FP8 values in place, the block scales as float32 (the format's own
        arithmetic: `products.Native`)."""
        if mapped or not native_applies(dtype, torch.float32):
            return []
        return [Native("fp8", "weight", local_shape[0], q.scale_name, q.block)]


FORMAT = HuggingFaceFP8()
