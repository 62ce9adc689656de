"""The sizing tools' decode figure against the measured one, for one model in float32, bf16, int8 and int4 (issue 47
item 4): `tpkit estimate` over each checkpoint directory (its quantized layers priced as the products a rank's load
runs, `tpkit.estimate.quantized`) against greedy decode measured at TP1 (one process) and TP2 (2 gloo processes),
one thread each, as `bench/quantized.py` measures it.

A Llama shape is drawn from `--seed` (`bench/quantized.py`'s `draw`: hidden, MLP width, layers; the seed and shape
are printed) and saved as float32, bf16 and compressed-tensors W8A16 (int8 per channel) / W4A16 (int4 group 128) of
the bf16 model (`bench/quantized.py`'s `make`; `--fp8` adds FP8 per channel). The profile is `--profile` (default: a
full calibration written to a temporary file first, `tpkit estimate --calibrate`: a few minutes). Each directory is
estimated by the CLI (`tpkit estimate DIR --world-size 1,2 --seq-len 12 --json`: the prompt's 8 tokens and the
decoded ones around it; float32 and bf16 at their dtype, quantized ones at the checkpoint's, the CLI's default),
then every format is loaded on 1 and on 2 ranks and decoded alternately (ms/token = (generate N - generate 1) /
(N - 1), median of `--repeats` rounds). Prints a markdown table (predicted / measured) with the load average seen,
and the streaming rate per rank as the calibration measures it (`measure_shared_stream_bandwidth`, every rank at
once), the profile's against the rate measured again right after each world's decode: this box's memory moves by a
third within minutes, and a prediction made from one moment's rates misses a measurement taken in another by that
much.

    python bench/quantized_prediction.py [--seed N] [--profile FILE] [--against FILE] [--repeats 3] [--tokens 9] [--fp8]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.quantized import VOCAB, _tp_rank, draw, heads_of, make  # noqa: E402

SEQ = 12  # the context the estimate decodes after: the prompt's 8 tokens and the tokens decoded around it
DTYPE = {"float32": "fp32", "bf16": "bf16"}  # the plain checkpoints' dtypes; quantized ones: the CLI's default


def predicted(path: str, fmt: str, profile: str) -> tuple[dict[int, float], list[str]]:
    """{world size: predicted ms/token} of `tpkit estimate` over `path`, and its speed notes."""
    cmd = [sys.executable, "-m", "tpkit.cli", "estimate", path, "--world-size", "1,2", "--seq-len", str(SEQ),
           "--profile", profile, "--json"] + (["--dtype", DTYPE[fmt]] if fmt in DTYPE else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    out = done.stdout
    speed = json.loads(out)["speed"]
    return {r["world_size"]: r["total_s"] * 1e3 for r in speed["rows"]}, speed["notes"]


def _stream_now() -> float:
    """This rank's streaming rate as the calibration measures it, every rank at once (bytes/s)."""
    import tpkit
    from tpkit.estimate.bandwidth import measure_shared_stream_bandwidth

    return measure_shared_stream_bandwidth(tpkit.get_communicator())


def main() -> None:
    import tpkit
    from tpkit.estimate.profile import load_profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="the shape's seed (default: drawn now, printed)")
    ap.add_argument("--profile", default=None, help="a calibrated profile (default: calibrate now into a temp file)")
    ap.add_argument("--against", default=None, help="a second profile: the same checkpoints priced by it too, against "
                    "the same measurements (a calibration change's A/B)")
    ap.add_argument("--tokens", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fp8", action="store_true", help="FP8 per channel too")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else int(time.time()) % 10000
    shape = draw(seed, False)
    print(f"seed {seed}: {shape}", flush=True)
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        profile = args.profile
        if profile is None:
            profile = os.path.join(tmp, "profile.json")
            subprocess.run([sys.executable, "-m", "tpkit.cli", "estimate", "--calibrate", "--profile", profile],
                           check=True, stdout=subprocess.DEVNULL)
            loads.append(os.getloadavg()[0])
        rates = load_profile(profile)  # (a calibration's temporary file goes with the directory)
        paths = make(tmp, shape)
        if not args.fp8:
            paths.pop("fp8")
        estimates = {f: predicted(p, f, profile) for f, p in paths.items()}
        others = {f: predicted(p, f, args.against)[0] for f, p in paths.items()} if args.against else None
        measured, streams = {}, {}
        for world in (1, 2):
            ranks = tpkit.launch(_tp_rank, world, args=(paths, args.tokens, args.repeats), timeout=3600)
            measured[world] = {f: max(r[f"decode_{f}"] for r in ranks) for f in paths}
            streams[world] = min(tpkit.launch(_stream_now, world, timeout=600))
            loads.append(os.getloadavg()[0])
    rows = ["| format | TP | measured ms/token | predicted ms/token | predicted / measured |"
            + (" by --against | / measured |" if others else ""), "|---|---|---|---|---|" + ("---|---|" if others else "")]
    for f in paths:
        for world in (1, 2):
            m, p = measured[world][f], estimates[f][0][world]
            rows.append(f"| {f} | {world} | {m:.1f} | {p:.1f} | {p / m:.2f} |"
                        + (f" {others[f][world]:.1f} | {others[f][world] / m:.2f} |" if others else ""))
    print("\n".join(rows))

    def calibrated(world: int) -> str:  # the calibration's rate at its start (and at its end, where it has one)
        r = rates.rates(world)
        return f"{r.stream_bandwidth / 1e9:.1f}" + (f" / {r.stream_bandwidth_end / 1e9:.1f}" if r.stream_bandwidth_end
                                                     else "")
    print("\nStreaming per rank (the calibration's probe): the profile's (start / end of its calibration) -> right "
          "after the decode: " + ", ".join(f"TP{w} {calibrated(w)} -> {streams[w] / 1e9:.1f} GB/s" for w in (1, 2)))
    notes = sorted({n for f in paths for n in estimates[f][1] if "quantized" in n})
    print("\n".join(f"note: {n}" for n in notes))
    print(f"\nLlama hidden {shape['hidden']}, MLP {shape['mlp']}, {shape['layers']} layers, "
          f"{' / '.join(map(str, heads_of(shape)))} heads, vocabulary {VOCAB} (seed {seed}); "
          f"1 and 2 gloo processes, 1 thread each; {args.tokens} tokens, median of {args.repeats} alternating rounds; "
          f"profile {profile if args.profile else 'calibrated in the run'}; "
          f"load average {min(loads):.2f}-{max(loads):.2f}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {datetime.date.today().isoformat()}.")


if __name__ == "__main__":
    main()
