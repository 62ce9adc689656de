"""`tpkit estimate ... --plot out.png`: per-rank memory by part and throughput against world size.

Two panels, because they answer the two sizing questions: does a rank fit (stacked bars of weights,
gradients, optimizer states, activations, KV cache against the device's memory), and what adding ranks
buys (decode tokens/s, or steps' tokens/s, against world size). matplotlib is the `plot` extra, as for
`tpkit bench --plot`.
"""
from __future__ import annotations

_PARTS = (("weights", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer_states"),
          ("activations", "activations"), ("KV cache", "kv_cache"), ("comm buffers", "communication_buffers"))


def plot_estimate(estimates, speed, path: str, title: str, device_bytes: float | None = None) -> None:
    """Write the PNG: memory per rank (stacked, GiB) and, when `speed` is given, throughput per world size."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'tpkit[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if speed is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 3.8), squeeze=False)
    ax = axes[0][0]
    sizes = [e.world_size for e in estimates]
    labels = [str(t) for t in sizes]
    bottom = [0.0] * len(estimates)
    for label, field in _PARTS:
        values = [getattr(e.per_rank, field) / 1024**3 for e in estimates]
        if any(values):
            ax.bar(labels, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
    if device_bytes:
        ax.axhline(device_bytes / 1024**3, color="k", ls="--", lw=1, label="device memory")
    first = estimates[0]
    ax.set_title(f"memory per rank ({first.mode}, {first.dtype})")
    ax.set_xlabel("world size (TP)")
    ax.set_ylabel("GiB")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    if speed is not None:
        ax = axes[0][1]
        rows = speed.rows
        ax.plot([r.world_size for r in rows], [r.tokens_per_s for r in rows], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r.world_size for r in rows], [str(r.world_size) for r in rows])
        ax.set_title(f"{speed.mode} {speed.unit}/s ({speed.hardware})")
        ax.set_xlabel("world size (TP)")
        ax.set_ylabel(f"{speed.unit}/s")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    _save_atomically(fig, path)
    plt.close(fig)


def _save_atomically(fig, path: str) -> None:
    """A temporary PNG in the same directory, renamed over `path`: a reader never sees half a picture."""
    import os
    import tempfile

    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".plot-", suffix=".png", dir=directory)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
