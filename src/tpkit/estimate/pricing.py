"""Which machine an estimate prices, decided in one place so `analyze`, `estimate`, `search` and the demo give
figures from the same model of the same machine.

In order: a `hardware` named by the caller (a datasheet, for another machine: said so in the first line); the
profile file given, else the one at the default location (`tpkit estimate --calibrate` wrote it); a GPU of a
known kind (its datasheet scaled by the default profile's achieved fractions); else this machine is measured
now (a quick calibration, written to the default location so the next command reads it). A CPU host is never
priced as a GPU unless asked: that gave a 100M Llama 0.64 ms/step on a 2-core box.
"""
from __future__ import annotations

import dataclasses
import os
import time

from .hardware import Hardware, detect_hardware, get_hardware, local_devices
from .profile import DEFAULT_PROFILE, SpeedProfile, default_profile_path, load_profile, save_profile


class NotPriced(ValueError):
    """Nothing prices this machine (no profile, no hardware named, no GPU of a known kind) and measuring it was not
    asked for (`calibrate=False`): the caller falls back (the demo's memory rule) or says how to measure."""


@dataclasses.dataclass(frozen=True)
class Pricing:
    """The machine the figures are for: the profile to price with, a datasheet `hardware` when that is what
    prices (None: the profile's measured rates), whether it is this machine, how many devices (GPUs, else
    cores) this machine has, and `origin`, the one line that says all of it."""

    profile: SpeedProfile
    hardware: Hardware | None
    this_machine: bool
    devices: int
    device_kind: str
    origin: str

    @property
    def measured(self) -> bool:
        """Priced by rates measured op by op (`MachineRates`), not a datasheet."""
        return self.hardware is None and bool(self.profile.machine)

    def beyond(self, world_size: int) -> bool:
        """Whether `world_size` devices exceed what this machine has (a figure for another machine)."""
        return self.this_machine and world_size > self.devices


def _measured_when(profile: SpeedProfile) -> str:
    return profile.sources.get("measured", profile.name)


def machine_pricing(profile: SpeedProfile | str | None = None, hardware: str | Hardware | None = None,
                    interconnect: str | None = None, calibrate: bool = True, backend: str = "gloo",
                    dp_wrappers=None) -> Pricing:
    """The machine to price (see the module doc). `profile`: a `SpeedProfile` or a path; `hardware`: a preset
    name or `Hardware` (prices that datasheet, not this machine); `calibrate`: measure this machine when nothing
    else prices it (False: `NotPriced`, a ValueError, instead), with `dp_wrappers` (`calibrate_profile`'s) when given."""
    devices, kind = local_devices()
    if hardware is not None:
        hw = get_hardware(hardware, interconnect)
        prof = profile if isinstance(profile, SpeedProfile) else load_profile(profile) if profile else DEFAULT_PROFILE
        if prof.machine:  # measured rates belong to the machine measured; a named datasheet asks for another one
            prof = DEFAULT_PROFILE
        return Pricing(prof, hw, False, devices, kind,
                       f"priced for {hw.name} over {hw.interconnect.name} from its datasheet x profile "
                       f"{prof.name!r} (asked for: --hardware), not this machine")
    if isinstance(profile, SpeedProfile):
        return _from_profile(profile, "the given profile", devices, kind)
    path = profile or default_profile_path()
    if profile or os.path.exists(path):
        return _from_profile(load_profile(path), path, devices, kind)
    gpu = detect_hardware()
    if gpu is not None:
        return Pricing(DEFAULT_PROFILE, gpu, True, devices, kind,
                       f"priced for this machine's {gpu.name} from its datasheet x profile {DEFAULT_PROFILE.name!r}; "
                       f"`tpkit estimate --calibrate` measures it")
    if not calibrate:
        raise NotPriced(f"no speed profile at {path} and no GPU of a known kind: run `tpkit estimate --calibrate` "
                        f"to measure this machine, or name the hardware to price (e.g. H100-SXM)")
    from .calibrate import calibrate_profile

    began = time.perf_counter()
    measured = calibrate_profile(backend, (2,), quick=True, dp_wrappers=dp_wrappers)
    save_profile(measured, path)
    return Pricing(measured, None, True, devices, kind,
                   f"priced by this machine measured now (no profile at {path}: quick calibration, "
                   f"{time.perf_counter() - began:.0f} s, written there; `tpkit estimate --calibrate` measures "
                   f"it fully)")


def _from_profile(profile: SpeedProfile, where: str, devices: int, kind: str) -> Pricing:
    if profile.machine:
        return Pricing(profile, None, True, devices, kind,
                       f"priced by the measured profile {where} ({_measured_when(profile)})")
    hw = profile.hardware or detect_hardware()
    if hw is None:
        raise ValueError(f"speed profile {where} ({profile.name!r}) names no machine and measured none: run "
                         f"`tpkit estimate --calibrate`, or name the hardware to price")
    return Pricing(profile, hw, detect_hardware() is not None, devices, kind,
                   f"priced for {hw.name} from its datasheet x profile {profile.name!r} ({where})")
