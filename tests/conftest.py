"""Suite-wide settings: no hub, one shared model cache, no display needed."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Tests never reach a model hub; demo models are built locally from configs.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# The same cache as `make run`/`make test`, so models are built once per checkout.
os.environ.setdefault("FLOTILLA_CACHE", str(REPO / ".cache" / "flotilla"))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


# In CI a skipped test is a failed promise: every prerequisite (root, iproute2,
# two cores, xvfb...) is installed by `make test`, so a skip means set-up broke.
# Only reasons a user would accept on this machine kind stay skips.
ACCEPTED_SKIP_REASONS = ("needs a GPU", "needs an NPU", "needs Windows", "needs macOS")


def pytest_runtest_makereport(item, call):  # noqa: D103 - pytest hook
    import pytest

    if not os.environ.get("CI") or call.excinfo is None:
        return None
    if not call.excinfo.errisinstance(pytest.skip.Exception):
        return None
    reason = str(call.excinfo.value)
    if any(ok in reason for ok in ACCEPTED_SKIP_REASONS):
        return None
    from _pytest.reports import TestReport

    report = TestReport.from_item_and_call(item, call)
    report.outcome = "failed"
    report.longrepr = f"skipped in CI, which must not skip: {reason}"
    return report



def _strict_importorskip(modname: str, *args, **kwargs):
    """In CI a missing module is a broken install, not a reason to skip."""
    import importlib

    return importlib.import_module(modname)


if os.environ.get("CI"):
    import pytest as _pytest

    _pytest.importorskip = _strict_importorskip


# The Linux bundle's build (PyInstaller, ~4-7 min on 2 cores) starts in the background
# as soon as the tests are collected, at the lowest CPU and I/O priority, so it runs in
# the time the other tests leave idle instead of after them; tests/installers waits for
# its cache entry (installers/build.py holds a lock while building). Its output is in
# build/dist-cache/background-build.log; a failed background build is redone (and its
# error shown) by the installers test itself. FLOTILLA_BACKGROUND_BUILD=0 turns it off.
_BACKGROUND_BUILD = None


def pytest_collection_finish(session):  # noqa: D103 - pytest hook
    import shutil
    import subprocess
    import sys

    global _BACKGROUND_BUILD
    if os.environ.get("FLOTILLA_BACKGROUND_BUILD", "1") == "0" or not sys.platform.startswith("linux"):
        return
    if shutil.which("dpkg-deb") is None or not any(
            Path(str(item.path)).is_relative_to(REPO / "tests" / "installers" / "test_installers_linux_bundle.py")
            for item in session.items):
        return
    log_dir = Path(os.environ.get("FLOTILLA_DIST_CACHE") or REPO / "build" / "dist-cache")
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "background-build.log", "w") as log:
        _BACKGROUND_BUILD = subprocess.Popen(
            [sys.executable, "-m", "installers.build", "--low-priority", "--install-tools", "--no-copy"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    import threading

    # Reap it the moment it exits: a finished build must not linger as our zombie child
    # (tests that look for processes their code left behind list this process's children).
    threading.Thread(target=_BACKGROUND_BUILD.wait, name="background-build-reaper", daemon=True).start()


def pytest_sessionfinish(session, exitstatus):  # noqa: D103 - pytest hook
    proc = _BACKGROUND_BUILD
    if proc is None or proc.poll() is not None:
        return
    import signal
    import time

    # Still running (the installers tests were not reached): stop the build we started, by its pid.
    os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:  # the reaper thread waits on it
        time.sleep(0.2)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
