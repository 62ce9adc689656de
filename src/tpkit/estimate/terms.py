"""A measured profile's terms as lines of text, one term per line, read from the profile itself: what
`tpkit estimate --calibrate` prints is what it wrote (the command prints the file it just saved, read back).
"""
from __future__ import annotations

from .ops import DENSE, FRESH_BLOCK_BYTES
from .profile import SpeedProfile


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB/s"


def _gf(x: float) -> str:
    return f"{x / 1e9:.1f} GFLOP/s"


def _us(x: float) -> str:
    return f"{x * 1e6:.1f} us" if x < 1e-3 else f"{x * 1e3:.2f} ms"


def _bytes(n: float) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 2**10:g} KiB"


def profile_terms(profile: SpeedProfile) -> list[str]:
    """One line per measured term of `profile`, for each number of ranks sharing the machine (see
    `machine.MachineRates` and `framework.py` for what each one is)."""
    lines = []
    if profile.hardware is not None:
        hw = profile.hardware
        lines.append(f"machine: {hw.name}; {hw.memory_bytes / 2**30:.1f} GiB memory")
    for key in sorted(profile.machine, key=int):
        r = profile.machine[key]
        who = f"{r.ranks} rank{'s' if r.ranks > 1 else ''} at once, {r.threads} thread{'s' if r.threads > 1 else ''} each"
        alone = "alone" if r.ranks == 1 else f"while all {r.ranks} stream at once"
        end = f" at the start, {_gb(r.stream_bandwidth_end)} at the end" if r.stream_bandwidth_end else ""
        lines.append(f"[{who}] weight streaming bandwidth per rank ({alone}): {_gb(r.stream_bandwidth)}{end}; as "
                     f"stored (Conv1D): {_gb(r.stored_bandwidth or r.stream_bandwidth)}; elementwise: "
                     f"{_gb(r.copy_bandwidth)}")
        for how, tables in (("as stored, x @ W", sorted(((1024, r.gemm), *r.gemm_widths))),
                            ("as nn.Linear reads it, x @ W.T", r.linear_gemm),
                            *((f"as nn.Linear reads it, in {d}", t) for d, t in sorted(r.dtype_gemm.items()))):
            for width, table in tables:
                lines.append(f"[{who}] matmul at width {width}, weight read {how}, by rows: "
                             + ", ".join(f"{m}: {_gf(f)}" for m, f in sorted(table)))
        for key, q in sorted(r.quantized.items()):
            what = f"dense {key.split('/')[1]} layer's decode product" if key.startswith(f"{DENSE}/") \
                else f"quantized layer {key}"
            lines.append(f"[{who}] {what} ({q.product}): {_us(q.fixed_s)} per call beyond the framework terms' linear "
                         f"call + stored bytes at, by rows: " + ", ".join(f"{m}: {_gb(b)}" for m, b in q.rows)
                         + ("; at 1 row by input width: " + ", ".join(f"{w}: {_gb(q.bandwidth(1, w))}"
                                                                      for w, _ in q.widths) if q.widths else ""))
        if r.fresh_bandwidth:
            lines.append(f"[{who}] new pages for a tensor of {_bytes(FRESH_BLOCK_BYTES)} or more (not kept by the "
                         f"allocator), beyond writing it: {_gb(r.fresh_bandwidth)}")
        lines.append(f"[{who}] a process holds besides its tensors: {r.import_bytes / 2**20:.0f} MiB once torch, tpkit "
                     f"and transformers are imported, {r.runtime_bytes / 2**20:.0f} MiB of runtime in a training step")
        lines.append(f"[{who}] fixed cost per op (reference model): forward {_us(r.op_overhead_s)}, training "
                     f"{_us(r.train_op_overhead_s)}; AdamW per parameter tensor {_us(r.optimizer_tensor_s)}")
        for title, table in (("framework, whole model", r.framework),
                             (f"framework, converted over {r.ranks} ranks", r.tp_framework),
                             (f"framework, data parallel over {r.ranks} ranks", r.dp_framework)):
            for name, cost in sorted(table.items()):
                per = "token (generate)" if "/decode" in name else "step"
                rows = (f" + {_us(cost.row_s)} per further batch row + {cost.logit_s * 1e9:.2f} ns per further "
                        f"logit" if "/decode" in name else "")
                lines.append(f"[{who}] {title}: {name}: {_us(cost.step_s)} per {per} + {_us(cost.layer_s)} per "
                             f"decoder layer{rows}")
        for kind, per in sorted(r.collectives.items()):
            for group, c in sorted(per.items()):
                measured = (", timed (priced between these points): "
                            + ", ".join(f"{_bytes(b)} {_us(t)}" for b, t in c.points)) if c.points else ""
                lines.append(f"[{who}] {kind} over {group} ranks: {_us(c.latency_s)} + bytes / {_gb(c.bandwidth)} "
                             f"(line fitted){measured}")
        if r.ranks > 1:
            lines.append(f"[{who}] a collective inside a step beyond the isolated call (reference model): forward "
                         f"{_us(r.collective_overhead_s)}, training {_us(r.train_collective_overhead_s)}")
            lines.append(f"[{who}] work between collectives when the ranks meet at each (the wait for the slower "
                         f"rank): +{r.skew:.1%} streamed from memory (decode), +{r.train_skew:.1%} bound by arithmetic")
    return lines
