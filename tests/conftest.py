"""Every test prices the same made-up measured machine unless it names its own profile: with no profile,
`tpkit estimate`, `search` and `analyze` measure this machine first (`tpkit.estimate.pricing`; the demo never does),
which takes minutes and would write the developer's ~/.cache. A test that wants that path sets $TPKIT_PROFILE
itself (monkeypatch wins over this fixture)."""
from __future__ import annotations

import os

import pytest

from tpkit.estimate.framework import FAMILIES, FrameworkCost
from tpkit.estimate.hardware import Hardware, Interconnect
from tpkit.estimate.machine import CollectiveCost, MachineRates
from tpkit.estimate.profile import LinkProfile, SpeedProfile, save_profile


def synthetic_profile() -> SpeedProfile:
    """A measured-looking profile of a 2-rank CPU machine, figures of the order this 2-core box measures."""
    gemm = ((1, 5e9), (16, 20e9), (256, 100e9), (1024, 100e9))
    coll = {k: {"2": CollectiveCost(80e-6, 1e9)} for k in ("all_reduce", "all_gather", "reduce_scatter")}
    terms = {f"{f}/{g}": FrameworkCost(1e-3, 0.5e-3) for f in FAMILIES for g in ("decode", "train")}
    dp = {f"{f}/train/{m}": FrameworkCost(1e-3, 0.5e-3) for f in FAMILIES for m in ("ddp", "fsdp")}
    machine = {str(n): MachineRates(n, 1, 4e-6, 3e-6, gemm, 10e9 / n, 9e9 / n, coll if n > 1 else {},
                                    framework=terms, tp_framework=terms if n > 1 else {}, optimizer_tensor_s=10e-6,
                                    import_bytes=300 * 2**20, runtime_bytes=20 * 2**20,
                                    dp_framework=dp if n > 1 else {})
               for n in (1, 2)}
    hw = Hardware("synthetic: 2 cores", 2e11, 1e11, 10e9, 16 * 2**30,
                  Interconnect("gloo on this host (measured)", 1e9, 40e-6, "gloo"))
    return SpeedProfile("synthetic: 2 cores", 1.0, 1.0, {"gloo": LinkProfile(0.0, 40e-6, 1.0)}, hw,
                        {"measured": "synthetic, for tests"}, machine)


@pytest.fixture(scope="session")
def synthetic_profile_path(tmp_path_factory) -> str:
    return save_profile(synthetic_profile(), str(tmp_path_factory.mktemp("profile") / "profile.json"))


@pytest.fixture(scope="session", autouse=True)
def _hermetic_profile_for_the_session(synthetic_profile_path):
    """The same for module and session fixtures, which run before any function fixture: a module fixture that
    searched (tests/test_training_paths.py's) found no profile on a fresh machine and calibrated it, 5+ minutes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPKIT_PROFILE", synthetic_profile_path)
        yield


@pytest.fixture(autouse=True)
def _hermetic_profile(monkeypatch, synthetic_profile_path):
    monkeypatch.setenv("TPKIT_PROFILE", synthetic_profile_path)


@pytest.fixture
def forced_native(monkeypatch) -> list[str]:
    """tpkit's native product chosen wherever a choice offers it (whatever this box would measure), and the kinds it
    ran, call by call. Skips where no compiler built it."""
    from tpkit.quant import native, products

    if not native.available():
        pytest.skip("no C compiler: every product is torch's")
    monkeypatch.setattr(products, "fastest", lambda candidates, *a, **k: candidates[1])
    monkeypatch.setattr(products, "_CHOSEN", {})
    kinds, real = [], native.gemv

    def counted(x, w, kind, *args, **kwargs):
        kinds.append(kind)
        return real(x, w, kind, *args, **kwargs)
    monkeypatch.setattr(native, "gemv", counted)
    return kinds


# Most launched ranks build a Hugging Face model (and tests/trainer's run its Trainer): the fork server imports
# transformers' modeling core and Trainer once, not every rank (about 2-3 s of a core per rank process;
# `tpkit.launch.preload`).
os.environ.setdefault("TPKIT_PRELOAD", "transformers.modeling_utils,transformers.trainer")

# Every test decides its plans: tests spy on the trace, and none may read a plan an earlier test or run stored in the
# developer's ~/.cache (`checkpoint/plan_cache.py`; tests/checkpoint/test_plan_cache.py turns it on in a temporary
# directory). Set before any rank process starts, so every rank inherits it.
os.environ.setdefault("TPKIT_PLAN_CACHE", "0")

# `make test` runs the files on two pytest-xdist workers (`-n 2`): the suite keeps about one of the box's two cores
# busy on its own (processes that wait on each other, Python between the ops). A file stays on one worker (its module
# fixtures are built once); files that share a session fixture stay together (it is built once); the slowest files
# are handed out first, so that no worker is left with a long file at the end.
SHARED_FIXTURE_GROUPS = {
    "tests/estimate/test_estimate_calibrate.py": "quick_calibration",  # estimate/conftest.py quick_calibration
    "tests/estimate/test_user_sequence.py": "quick_calibration",
    "tests/pipeline/": "pipeline_launch",  # pipeline/conftest.py launched: one launch of 4 gloo processes
    "tests/models/": "model_references",  # models/conftest.py hf_reference, moe_reference
}
SLOWEST_FIRST = ("tests/test_training_paths.py", "tests/test_docs.py", "quick_calibration", "tests/test_examples.py",
                 "tests/test_lora.py", "tests/quant/test_checkpoints.py", "tests/convert/test_cli.py")


def _group(nodeid: str) -> str:
    """The worker unit of a test: its file, or the name of the files that share a session fixture with it."""
    path = nodeid.split("::", 1)[0]
    for prefix, group in SHARED_FIXTURE_GROUPS.items():
        if path.startswith(prefix):
            return group
    return path


def pytest_collection_modifyitems(items) -> None:
    """The slowest groups first (each worker collects, and the scheduler hands the groups out in this order); the
    rest keep their order. Without xdist only the order changes."""
    rank = {group: i for i, group in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item.nodeid), len(rank)))  # stable: files stay in order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduler with `_group` as the scope. (Not `--dist loadgroup`: its marks rename the test ids,
    which pytest 9 no longer lets a plugin do.)"""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return FileGroupScheduling(config, log)


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    """Seconds per test file (setup, call and teardown of its cases), for the summary below."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """The files that take longest, with their share of the run: where `make test`'s time goes (issue 46 keeps it
    under 15 minutes on the 2-core box)."""
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.section(f"seconds per test file (top 30 of {len(_FILE_SECONDS)}; all files {total:.0f} s)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])[:30]:
        terminalreporter.write_line(f"{seconds:8.1f} s {100 * seconds / total:5.1f}%  {path}")

