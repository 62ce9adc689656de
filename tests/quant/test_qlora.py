"""QLoRA under tensor parallelism: LoRA on a quantized TP base (frozen, packed) trains like stock PEFT on the same
quantized base in one process (issue 37 item 7 on issue 36's checkpoints).

The reference: transformers' single-process load of the compressed-tensors directory (dequantized), stock PEFT's
LoRA on it, AdamW. The TP side: `tpkit.from_pretrained` of the same directory (packed int4 layers, int4 kernel
where the input needs no gradient), `peft.get_peft_model` with the same config and seed. Losses and the adapter
after the steps must agree at float32 rounding at 2 and 3 ranks (at 3, KV rows held by two ranks: their LoRA B
rows take the base's row sums from the quantized layer).
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import tpkit
from tpkit.comm import run_threads
from tpkit.nn.quantized import quant_method_of
from tests.quant import checkpoints as C

peft = pytest.importorskip("peft")
pytest.importorskip("compressed_tensors")

_LOCK = threading.Lock()
STEPS = 4
CONFIG = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
              target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    directory = C.compressed_tensors(C.llama(), str(tmp_path_factory.mktemp("qlora") / "int4"), "pack-quantized",
                                     num_bits=4, type="int", symmetric=False, strategy="group", group_size=128)
    ref = peft_model(C.reference(directory))
    grads: dict = {}
    losses = train(ref, grads)
    return directory, losses, grads, {n: p.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}


def peft_model(model):
    with _LOCK:  # thread-ranks share torch's global RNG
        torch.manual_seed(7)
        return peft.get_peft_model(model, peft.LoraConfig(**CONFIG))


def train(model, first_grads: dict) -> list[float]:
    """STEPS AdamW steps; the adapter's gradients of the first step go to `first_grads`."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, C.VOCAB, (2, 12), generator=torch.Generator().manual_seed(100 + step))
        logits = model(ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        if step == 0:
            first_grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("world", [2, 3])
def test_lora_on_a_packed_base_trains_like_stock_peft(quantized, world):
    directory, want, want_grads, adapter = quantized

    def body(comm):
        model = peft_model(tpkit.from_pretrained(directory, comm=comm, progress=False))
        down = model.base_model.model.model.layers[0].mlp.down_proj.base_layer
        assert quant_method_of(down) is not None and not any(p.requires_grad for p in down.parameters())
        grads: dict = {}
        losses = train(model, grads)
        lays, bad = tpkit.shard_layouts(model), []
        # float32: first-step gradients within 1e-4 (measured <= 2e-6; a lost row sum is O(1)); after four AdamW
        # steps, whose first updates are ~lr * sign(g), near-zero gradients leave up to ~2e-3 on the adapter
        for what, got, full, tol in [(f"grad {n}", grads[n], want_grads[n], 1e-4) for n in grads] + \
                [(n, p, adapter[n], 5e-3) for n, p in model.named_parameters() if p.requires_grad]:
            name = what.split(" ")[-1]
            ref = lays[name].shard(full) if name in lays else full
            err = float((got - ref).abs().max() / ref.abs().max())
            if not err < tol:
                bad.append(f"rank {comm.rank} {what}: rel {err:.2e}")
        return losses, bad

    for losses, bad in run_threads(body, world):
        assert not bad, bad[:6]
        assert max(abs(a - b) / b for a, b in zip(losses, want)) < 1e-5, (losses, want)


def test_merging_into_a_packed_base_is_refused(quantized):
    from tpkit.nn.lora import LoraTPError

    directory = quantized[0]

    def body(comm):
        model = peft_model(tpkit.from_pretrained(directory, comm=comm, progress=False))
        with pytest.raises(LoraTPError, match=r"cannot merge a LoRA adapter into a quantized base layer .*int4 "
                                              r"group 128.*dequantize=True"):
            model.merge_adapter()
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        return layer.merged

    assert run_threads(body, 2) == [False, False]
