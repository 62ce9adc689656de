"""GPTQ checkpoints (AutoGPTQ / GPTQModel, v1 `gptq` checkpoint format): `quant_method: gptq`.

A layer stores `qweight` (`[in / 8, out]` for 4 bits: 32 // bits unsigned values per int32 word, packed along the
INPUT), `qzeros` (`[groups, out / 8]`, packed along the output, each zero point stored minus one: the v1 format),
`scales` (`[groups, out]`) and `g_idx` (`[in]`: each input column's group; with `desc_act` the groups are not in
column order). `w = (q - z) * s` in the scales' dtype, each column through its own group. `gptq_v2`, 2 / 3-bit
weights and other packings are refused. The LM head stays dense unless the config says otherwise.
"""
from __future__ import annotations

import torch

from .format import Format, Refused, Roles
from .packing import unpack_bits
from .schemes import DimRule, Quantization, StoredTensor, WeightQuant, groups

METHOD = "gptq"


class GPTQ(Format):
    method = METHOD
    supported = "gptq (4/8-bit, v1 'gptq' format, desc_act)"

    def read(self, qc: dict) -> Quantization:
        bits, fmt = int(qc.get("bits", 4)), qc.get("checkpoint_format", "gptq")
        if bits not in (4, 8) or fmt != "gptq":
            raise Refused(f"{bits}-bit weights in checkpoint_format {fmt!r}")
        group = int(qc.get("group_size", -1))
        scheme = WeightQuant(METHOD, "gptq", bits, False, "group" if group > 0 else "channel",
                             group_size=group if group > 0 else None, act_order=bool(qc.get("desc_act", False)))
        return Quantization(METHOD, qc, ((("Linear",), scheme),),
                            tuple(qc.get("modules_to_not_convert") or ("lm_head",)))

    def stored_tensors(self, q: WeightQuant, out: int, in_: int) -> list[StoredTensor]:
        per, n_in = 32 // q.bits, groups(in_, q.group_size or in_)
        scale_in = DimRule(None) if q.act_order else DimRule(1, 1, q.group_size or in_)
        return [StoredTensor("qweight", (groups(in_, per), out), torch.int32, (DimRule(1, per), DimRule(0))),
                StoredTensor("qzeros", (n_in, groups(out, per)), torch.int32, (scale_in, DimRule(0, per))),
                StoredTensor("scales", (n_in, out), None, (scale_in, DimRule(0))),
                StoredTensor("g_idx", (in_,), torch.int32, (DimRule(1),))]

    def roles(self, q: WeightQuant) -> Roles:
        return Roles("qweight", "scales", "qzeros", "g_idx")

    def values(self, q: WeightQuant, name: str, t: torch.Tensor) -> torch.Tensor:
        if name == "qweight":
            return unpack_bits(t, q.bits, 0)
        if name == "qzeros":
            return unpack_bits(t, q.bits, 1) + 1  # the v1 format stores zero points minus one
        return t


FORMAT = GPTQ()
