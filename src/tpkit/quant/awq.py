"""AWQ checkpoints (AutoAWQ's GEMM version): `quant_method: awq`.

A layer stores `qweight` (`[in, out / 8]`: eight unsigned 4-bit values per int32 word packed along the OUTPUT, in
AWQ's interleaved order 0 2 4 6 1 3 5 7), `qzeros` (`[groups, out / 8]`, the same packing) and `scales`
(`[groups, out]`). `w = (q - z) * s` in the scales' dtype. Other versions (GEMV, Marlin, exllama) and AWQ without
zero points are refused. The LM head stays dense unless the config says otherwise.
"""
from __future__ import annotations

import torch

from .format import Format, Refused, Roles
from .packing import AWQ_UNPACK_ORDER, unpack_bits
from .schemes import DimRule, Quantization, StoredTensor, WeightQuant, groups

METHOD = "awq"


class AWQ(Format):
    method = METHOD
    supported = "awq (4-bit, version 'gemm')"

    def read(self, qc: dict) -> Quantization:
        bits, version = int(qc.get("bits", qc.get("w_bit", 4))), str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not qc.get("zero_point", True):
            raise Refused(f"{bits}-bit version {version!r} (zero_point={qc.get('zero_point', True)})")
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        scheme = WeightQuant(METHOD, "awq", 4, False, "group", group_size=group)
        return Quantization(METHOD, qc, ((("Linear",), scheme),),
                            tuple(qc.get("modules_to_not_convert") or ("lm_head",)))

    def stored_tensors(self, q: WeightQuant, out: int, in_: int) -> list[StoredTensor]:
        per, g = 32 // q.bits, q.group_size
        n_in = groups(in_, g)
        return [StoredTensor("qweight", (in_, groups(out, per)), torch.int32, (DimRule(1), DimRule(0, per))),
                StoredTensor("qzeros", (n_in, groups(out, per)), torch.int32, (DimRule(1, 1, g), DimRule(0, per))),
                StoredTensor("scales", (n_in, out), None, (DimRule(1, 1, g), DimRule(0)))]

    def roles(self, q: WeightQuant) -> Roles:
        return Roles("qweight", "scales", "qzeros", "g_idx")

    def values(self, q: WeightQuant, name: str, t: torch.Tensor) -> torch.Tensor:
        if name in ("qweight", "qzeros"):
            return unpack_bits(t, q.bits, 1, AWQ_UNPACK_ORDER)
        return t


FORMAT = AWQ()
