"""The most tensor memory a rank holds at any moment of a step, read off a fake run: every tensor an op makes is
followed until Python lets it go, so the peak counts what a sum of parts misses (the logits and their gradient
alive together, gradients appearing while activations are still held, the optimizer's temporaries).

Why: a sum of parameters, gradients, optimizer states and saved activations came out 0.4 GiB under the peak RSS of
a 100M Llama's training step (2.27 GiB measured, 1.63 predicted, 0.24 of it imports). `fake_step.trace_step`
runs its step under this mode (a weightless copy converted for the rank, `FakeTensorMode`: the same tensors a real
step makes, none allocated); storages are counted once however many views share them. The training step followed is
the steady one, whose optimizer states exist from its start (on a real second step the count equals the fake one to
the byte: tests/estimate/test_search.py). What a process holds on top (the interpreter and its
imports, the allocator's and autograd's own objects) is measured on the machine (`machine.MachineRates.import_bytes`,
`runtime_bytes`) and added apart (`predict.Prediction.process_bytes`).
"""
from __future__ import annotations

import weakref
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages that ops' outputs hold while any tensor on them is alive; `peak` is the
    most at once. `held`: tensors alive throughout (parameters, buffers, optimizer states), counted once from the
    start; an op writing into one in place (the optimizer's `param.addcdiv_`, `exp_avg.lerp_`) adds nothing."""

    def __init__(self, held=()):
        super().__init__()
        self.live: dict[int, list] = {}  # storage key -> [bytes, tensors alive on it]
        self.now = 0
        for t in held:
            key = t.untyped_storage()._cdata
            if key not in self.live:
                self.live[key] = [t.untyped_storage().nbytes(), float("inf")]
                self.now += self.live[key][0]
        self.peak = self.now

    def hold(self, tensors) -> None:
        """Count `tensors` as held from now on (optimizer states made outside the mode)."""
        for t in tensors:
            key = t.untyped_storage()._cdata
            if key not in self.live:
                self.live[key] = [t.untyped_storage().nbytes(), float("inf")]
                self.now += self.live[key][0]
        self.peak = max(self.peak, self.now)

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    def _hold(self, t: torch.Tensor) -> None:
        key = t.untyped_storage()._cdata
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [t.untyped_storage().nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self._hold(t)
        return out
