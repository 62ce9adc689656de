"""How long `tpkit.launch` takes to start its gloo ranks and get a trivial result back: the fork server (ranks forked
from a process that imported torch and tpkit once) against spawn (each rank a fresh interpreter importing them).

Each round runs both, alternating, at each world size; the figure is the median of the rounds. The fork server's
first launch (which starts the server) is reported apart: a program pays it once.

    PYTHONPATH=src python bench/launch.py [--rounds 7] [--world-sizes 2,3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import tpkit


def _rank() -> int:
    return tpkit.get_communicator().rank


def _timed(method: str, world: int) -> float:
    os.environ["TPKIT_START_METHOD"] = method
    start = time.perf_counter()
    assert tpkit.launch(_rank, world) == list(range(world))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--world-sizes", default="2,3")
    args = parser.parse_args()
    worlds = [int(w) for w in args.world_sizes.split(",")]
    first = _timed("forkserver", worlds[0])
    times = {(m, w): [] for m in ("forkserver", "spawn") for w in worlds}
    for _ in range(args.rounds):
        for w in worlds:
            for m in ("forkserver", "spawn"):
                times[m, w].append(_timed(m, w))
    print(f"{time.strftime('%Y-%m-%d %H:%M')} load {os.getloadavg()[0]:.1f}; first launch (starts the server, "
          f"{worlds[0]} ranks): {first:.2f} s")
    print("| ranks | fork server | spawn | ratio |\n|---|---|---|---|")
    for w in worlds:
        fs, sp = statistics.median(times["forkserver", w]), statistics.median(times["spawn", w])
        print(f"| {w} | {fs:.2f} s | {sp:.2f} s | {fs / sp:.3f} |")


if __name__ == "__main__":
    main()
