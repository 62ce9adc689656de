"""What this process holds, read from /proc: the calibration measures a rank's resident size once torch, tpkit and
transformers are imported and the runtime a training step adds beyond its tensors (`calibrate._rank_rates`), and
the memory estimate is checked against the peak resident size of a real step."""
from __future__ import annotations


def rss_bytes(which: str = "VmRSS") -> int:
    """This process's resident bytes now (`VmRSS`) or at its peak (`VmHWM`), from /proc (0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(which + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> None:
    """Start `VmHWM` again from the current resident size (Linux: /proc/self/clear_refs), where the OS allows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
