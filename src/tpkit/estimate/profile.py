"""The speed profile: what kernels and collectives achieve, as opposed to the datasheet peaks of `hardware.py`.

Two levels. For a GPU (or any machine known by its datasheet) a few physical parameters, not one factor per TP
size:

* `memory_efficiency`: achieved fraction of HBM bandwidth when streaming weights (decode is bound by it);
* `flops_efficiency`: achieved fraction of peak matmul FLOP/s (prefill, training);
* per interconnect kind (`LinkProfile`): a fixed cost per collective (`collective_latency_s`: kernel launch
  and the synchronisation every collective pays, whatever its size), a per-hop latency (`hop_latency_s`, the
  alpha of each of a ring's steps) and the achieved fraction of the link's one-way bandwidth.

`DEFAULT_PROFILE` is calibrated against published measurements (sources next to each figure). A measured
profile (`tpkit estimate --calibrate`, `calibrate.py`) also carries the machine itself as a `Hardware` whose
peaks are the measured figures (so its efficiencies are 1), and (format version 2) the op-level rates one rank
achieves when 1, 2, ... ranks share the machine (`machine`: `MachineRates` keyed by the number of ranks), which
the op-level predictions (`predict.py`) read; a profile measured nowhere gives them from a datasheet scaled by its
fractions (`SpeedProfile.rates`, `hardware.datasheet_rates`): one composition prices both. Profiles are JSON files,
written atomically, read with `json` only; `load_profile()` looks at `$TPKIT_PROFILE`, then `~/.cache/tpkit/profile.json`
(`$XDG_CACHE_HOME/tpkit/profile.json`), then falls back to the default.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field

from .hardware import Hardware, Interconnect, datasheet_rates, get_hardware
from .machine import MachineRates

VERSION = 3


@dataclass(frozen=True)
class LinkProfile:
    """What collectives achieve on one kind of link."""

    collective_latency_s: float   # fixed per collective: launch + synchronisation
    hop_latency_s: float          # per ring step
    bandwidth_efficiency: float   # achieved fraction of the link's one-way bandwidth


@dataclass(frozen=True)
class SpeedProfile:
    """Achieved fractions and latencies the speed estimate scales the peaks by (see the module doc)."""

    name: str
    memory_efficiency: float
    flops_efficiency: float
    links: dict[str, LinkProfile] = field(default_factory=dict)
    hardware: Hardware | None = None
    sources: dict[str, str] = field(default_factory=dict)
    machine: dict[str, MachineRates] = field(default_factory=dict)  # ranks sharing the machine -> one rank's rates

    def rates(self, ranks: int, hardware: Hardware | None = None, bytes_per_element: int = 2) -> MachineRates:
        """One rank's rates when `ranks` ranks share the machine: measured (the nearest measured count above, else
        the largest), or, for a profile not measured op by op, from `hardware`'s datasheet (default the
        profile's, else H100-SXM) scaled by the profile's fractions."""
        if self.machine:
            counts = sorted(int(k) for k in self.machine)
            return self.machine[str(min((c for c in counts if c >= ranks), default=counts[-1]))]
        hw = hardware or self.hardware or get_hardware("H100-SXM")
        return datasheet_rates(hw, self.flops_efficiency, self.memory_efficiency, self.link(hw.interconnect), ranks,
                               bytes_per_element)

    def link(self, interconnect: Interconnect) -> LinkProfile:
        """The calibrated figures for `interconnect`'s kind; the interconnect's own per-hop latency, no fixed
        cost and full bandwidth for a kind the profile does not know."""
        return self.links.get(interconnect.kind, LinkProfile(0.0, interconnect.latency_s, 1.0))

    def to_dict(self) -> dict:
        out = {"format": "tpkit-speed-profile", "version": VERSION, "name": self.name,
               "memory_efficiency": self.memory_efficiency, "flops_efficiency": self.flops_efficiency,
               "links": {k: asdict(v) for k, v in self.links.items()}, "sources": dict(self.sources),
               "machine": {k: v.to_dict() for k, v in self.machine.items()}}
        if self.hardware is not None:
            out["hardware"] = {**asdict(self.hardware), "interconnect": asdict(self.hardware.interconnect)}
        return out

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> "SpeedProfile":
        if not isinstance(data, dict) or data.get("format") != "tpkit-speed-profile":
            raise ValueError(f"{where}: not a tpkit speed profile (no \"format\": \"tpkit-speed-profile\"); "
                             f"write one with `tpkit estimate --calibrate`")
        try:
            links = {k: LinkProfile(**v) for k, v in data.get("links", {}).items()}
            hw = data.get("hardware")
            hardware = Hardware(**{**hw, "interconnect": Interconnect(**hw["interconnect"])}) if hw else None
            if int(data.get("version", 1)) > VERSION:
                raise ValueError(f"format version {data['version']} is newer than this tpkit reads ({VERSION})")
            machine = {str(k): MachineRates.from_dict(v) for k, v in dict(data.get("machine", {})).items()}
            profile = cls(str(data["name"]), float(data["memory_efficiency"]), float(data["flops_efficiency"]),
                          links, hardware, dict(data.get("sources", {})), machine)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: malformed speed profile ({type(exc).__name__}: {exc})") from None
        for what, value in (("memory_efficiency", profile.memory_efficiency),
                            ("flops_efficiency", profile.flops_efficiency),
                            *((f"links.{k}.bandwidth_efficiency", v.bandwidth_efficiency) for k, v in links.items())):
            if not 0 < value <= 1:
                raise ValueError(f"{where}: {what} must be in (0, 1], got {value}")
        return profile


# Calibrated on gpt-fast's published Llama-2-7B bf16 batch-1 decode on 8xA100-80GB (NVLink, 330 W, torch.compile):
# 104.9 / 168.84 / 254.02 / 328.43 tok/s at TP 1/2/4/8 (github.com/pytorch-labs/gpt-fast, README, "Tensor
# Parallelism"), each priced as the estimate prices it (the step traced op by op with gpt-fast's layout, embedding
# and LM head whole: `vocab_parallel=False`). Least squares over those four points (relative errors) with three
# parameters: memory efficiency 0.695, a fixed 17.1 us per all-reduce, 0.67 us per ring step (2(t - 1) steps),
# rounded below: +1.2%, -1.1%, +2.0%, -0.7%. Held out, the same README's Llama-2-70B at TP 2/4/8 (21.32 / 38.01 /
# 62.50 tok/s) comes out 9%, 6% and 4% low. (Priced by a roofline of the whole step, where the embedding's whole
# table counted as read, the same fit gave 0.70, 16 us and 0.6 us.)
_A100_NVLINK = LinkProfile(collective_latency_s=17e-6, hop_latency_s=0.7e-6,
                           # nccl-tests all_reduce_perf bus bandwidth on 8xA100 NVLink is commonly reported around
                           # 230-240 GB/s of the 300 GB/s one-way NVLink 3 figure; not validated by tpkit's tests
                           # (the decode messages above are 8-16 KB: latency-bound).
                           bandwidth_efficiency=0.78)
# No published PCIe TP runs were calibrated against: NCCL through the host typically doubles the fixed cost.
_PCIE = LinkProfile(collective_latency_s=30e-6, hop_latency_s=5e-6, bandwidth_efficiency=0.7)

DEFAULT_PROFILE = SpeedProfile(
    "default (calibrated on gpt-fast A100 decode)",
    memory_efficiency=0.70,   # gpt-fast Llama-2-7B TP1: 1397 GB/s achieved of the A100's 2039 GB/s (0.685)
    # Narayanan et al. 2021 (Megatron-LM, arXiv 2104.04473): 138-163 TFLOP/s per A100 (44-52% of 312 TFLOP/s)
    # for GPT models trained with TP x PP x DP; used for prefill too, where it is not validated here.
    flops_efficiency=0.5,
    links={"nvlink": _A100_NVLINK, "pcie": _PCIE},
    sources={"decode": "gpt-fast README, Llama-2-7B TP1/2/4/8 on 8xA100-80GB",
             "training": "Narayanan et al. 2021, arXiv 2104.04473"})

# Datasheet peaks and nothing else: what the estimate gave before calibration, for by-hand tests.
IDEAL_PROFILE = SpeedProfile("ideal (datasheet peaks)", 1.0, 1.0)


def default_profile_path() -> str:
    """Where `--calibrate` writes and estimates look: $TPKIT_PROFILE, else $XDG_CACHE_HOME (or ~/.cache)
    /tpkit/profile.json."""
    if os.environ.get("TPKIT_PROFILE"):
        return os.environ["TPKIT_PROFILE"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "tpkit", "profile.json")


def save_profile(profile: SpeedProfile, path: str | None = None) -> str:
    """Write `profile` as JSON atomically (temporary file in the same directory, fsync, rename); returns the
    path."""
    path = path or default_profile_path()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(profile.to_dict(), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_profile(path: str | None = None) -> SpeedProfile:
    """The profile at `path`; with no path, the default location's if a file is there, else `DEFAULT_PROFILE`."""
    if path is None:
        path = default_profile_path()
        if not os.path.exists(path):
            return DEFAULT_PROFILE
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"speed profile {path} does not exist; write one with `tpkit estimate --calibrate "
                         f"--profile {path}`") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"speed profile {path} is not JSON: {exc}") from None
    return SpeedProfile.from_dict(data, path)
