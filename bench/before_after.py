"""What the before/after benchmarks share: an earlier commit checked out beside this tree, and the table of medians.

`bench/estimate_commands.py` and `bench/decode_before_after.py` each time this tree against a commit in alternating
fresh processes; the commit lives in a `git worktree` for the run only, and each prints its figures as one table.
"""
from __future__ import annotations

import contextlib
import statistics
import subprocess
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
TREES = ("before", "this tree")


@contextlib.contextmanager
def checked_out(rev: str, where: Path) -> Iterator[dict[str, Path]]:
    """{"before": `rev` checked out at `where`, "this tree": this checkout}; the worktree removed afterwards."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(where), rev], check=True)
    try:
        yield {"before": where, "this tree": ROOT}
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=False)


def print_table(what: str, unit: str, names, runs: dict[tuple[str, str], list[float]], digits: int = 1) -> None:
    """One row per name: the median of `runs[name, tree]` for each tree, and this tree's over the earlier one's."""
    print(f"\n| {what} | before ({unit}) | this tree ({unit}) | ratio |\n|---|---:|---:|---:|")
    for name in names:
        a, b = (statistics.median(runs[name, t]) for t in TREES)
        print(f"| {name} | {a:.{digits}f} | {b:.{digits}f} | {b / a:.3f} |")
