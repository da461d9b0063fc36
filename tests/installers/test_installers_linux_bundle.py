"""The Linux package, built from a clean copy of the tree, works.

Builds the .deb with installers/build.py (PyInstaller + dpkg-deb; ~4-7 min on
2 cores, started in the background when the suite starts: tests/conftest.py;
reused within one CI run through the cache keyed by the sources and
the environment: build/dist-cache), unpacks it like dpkg would, and runs the
bundled executables from the unpacked /opt/flotilla, with no Python on PATH:
`--version`, a real chat with the demo model built from scratch in an empty
cache (tokenizer training, torch, optimum-intel export, OpenVINO CPU plugin),
a shard worker started the way the agent starts it (`flotilla -m ...`), the
agent, the desktop app through the `flotilla.gui` entry point (offscreen),
and `flotilla demo --headless` when this build's CLI has it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from installers import project as P  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(2400),  # the build (first test only) + a chat from an empty cache
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the .deb is built on Linux"),
    pytest.mark.skipif(shutil.which("dpkg-deb") is None or shutil.which("dpkg-shlibdeps") is None,
                       reason="needs dpkg-deb and dpkg-shlibdeps (dpkg-dev)"),
]


@pytest.fixture(scope="module")
def built():
    from installers import build

    build.ensure_build_tools()
    # The suite started this build in the background (tests/conftest.py); build() waits
    # for its cache lock and reuses the entry, or builds here if that run failed.
    summary = build.build(out_dir=None)
    print(f"\n[installers] build {'reused from cache' if summary['cached'] else 'done'} in "
          f"{summary['total_s']} s (PyInstaller {summary.get('pyinstaller_s')} s, .deb {summary.get('deb_s')} s); "
          f"bundle {summary['bundle_bytes'] / 2**20:.0f} MiB, .deb {summary['deb_bytes'] / 2**20:.0f} MiB "
          f"({summary.get('compression')})")
    return summary


@pytest.fixture(scope="module")
def unpacked(built, tmp_path_factory):
    root = tmp_path_factory.mktemp("deb-root")
    subprocess.run(["dpkg-deb", "-x", built["deb"], str(root)], check=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)  # the unpacked bundle is about as big as the .deb's contents


@pytest.fixture(scope="module")
def bundle_env(tmp_path_factory):
    """A user's environment: no Python of ours, empty cache/config/data."""
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "FLOTILLA_"))}
    env.update(HOME=str(home), FLOTILLA_CACHE=str(home / "cache"), FLOTILLA_CONFIG=str(home / "config"),
               FLOTILLA_DATA=str(home / "data"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               QT_QPA_PLATFORM="offscreen", PATH="/usr/bin:/bin")
    return env


def _run(exe: Path, *args: str, env: dict, timeout: float = 600, cwd: str | None = None) -> subprocess.CompletedProcess:
    """exe run as a user would, from cwd (default: the user's home)."""
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd or env["HOME"])


def test_package_metadata_and_layout(built, unpacked):
    proj = P.load()
    info = subprocess.run(["dpkg-deb", "-f", built["deb"], "Package", "Version", "Architecture", "Depends"],
                          capture_output=True, text=True, check=True).stdout
    assert f"Package: {proj.name}" in info and f"Version: {proj.version}" in info
    assert "libc6 (>=" in info and "libxcb-cursor0" in info  # computed by dpkg-shlibdeps
    for rel in ("opt/flotilla/flotilla", "opt/flotilla/flotilla-agent",
                "usr/share/applications/flotilla.desktop", "usr/share/applications/flotilla-agent.desktop",
                "usr/share/icons/hicolor/scalable/apps/flotilla.svg", "usr/share/icons/hicolor/48x48/apps/flotilla.png",
                "usr/share/flotilla/autostart/flotilla-agent.desktop", "usr/share/doc/flotilla/copyright",
                "opt/flotilla/_internal/assets/demo/corpus.txt"):
        assert (unpacked / rel).exists(), rel
    for exe in ("flotilla", "flotilla-agent"):
        link = unpacked / "usr" / "bin" / exe
        assert link.is_symlink() and os.readlink(link) == f"/opt/flotilla/{exe}"
    auto = (unpacked / "usr/share/flotilla/autostart/flotilla-agent.desktop").read_text()
    assert "Exec=/usr/bin/flotilla-agent" in auto and "TryExec=/usr/bin/flotilla-agent" in auto
    internal = unpacked / "opt/flotilla/_internal"
    # Left out on purpose (installers/bundle_rules.py).
    assert not (internal / "torchvision").exists() and not (internal / "torch" / "test").exists()
    assert not list(internal.glob("libcuda*")) and not list(internal.glob("libstdc++*"))
    assert not (internal / "sklearn").exists() and not (internal / "matplotlib").exists()
    # Sources read at run time (export cache key, inspect.getsource).
    assert (internal / "engine" / "shards" / "model.py").is_file()
    broken = [p for p in internal.rglob("*") if p.is_symlink() and not p.exists()]
    assert not broken, f"dangling links: {broken[:5]}"


def test_version_from_the_bundle(unpacked, bundle_env):
    res = _run(unpacked / "opt/flotilla/flotilla", "--version", env=bundle_env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"flotilla {P.load().version}"


def test_chat_with_the_demo_model_from_an_empty_cache(unpacked, bundle_env):
    t0 = time.monotonic()
    res = _run(unpacked / "opt/flotilla/flotilla", "chat", "--model", "demo", "-p", "hi", "--max-tokens", "4",
               env=bundle_env, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert res.stdout.strip(), "no answer"
    assert "tok/s" in res.stdout + res.stderr
    print(f"\n[installers] chat from an empty cache: {time.monotonic() - t0:.0f} s")


def test_workers_start_from_the_bundle(unpacked, bundle_env):
    """The agent and the local pipeline start shard workers as
    `sys.executable -m engine.shards.worker`; in a bundle that is flotilla itself."""
    for exe in ("flotilla", "flotilla-agent"):
        res = _run(unpacked / "opt/flotilla" / exe, "-m", "engine.shards.worker", "--help",
                   env=bundle_env, timeout=120)
        assert res.returncode == 0 and "--shard" in res.stdout, res.stderr[-3000:]
    res = _run(unpacked / "opt/flotilla/flotilla", "-c", "import openvino as ov; print(ov.Core().available_devices)",
               env=bundle_env, timeout=120)
    assert res.returncode == 0 and "CPU" in res.stdout, res.stderr[-3000:]


def test_agent_executable(unpacked, bundle_env):
    res = _run(unpacked / "opt/flotilla/flotilla-agent", "--help", env=bundle_env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--headless" in res.stdout and "pair" in res.stdout
    res = _run(unpacked / "opt/flotilla/flotilla-agent", "policy", env=bundle_env, timeout=120)
    assert res.returncode == 0 and json.loads(res.stdout)["idle_minutes"] > 0, res.stderr


def test_widening_kernels_compile_once_into_a_disk_cache(unpacked, bundle_env):
    """The MoE and sparse engines' 16-bit kernels (numba): the app's first engine process has
    them compiled into numba's disk cache (in a child that then exits), and later ones, from
    any folder, only load them: no compiler time or memory in each engine process."""
    exe = unpacked / "opt/flotilla/flotilla"
    code = ("from engine.runtime import widen_kernel as w; j = w._jit(); before = j.on_disk(); w.warm(); "
            "print(before, j.on_disk(), j.kernel.py_func.__code__.co_filename)")
    runs = []
    for cwd in (bundle_env["HOME"], str(unpacked)):
        res = _run(exe, "-c", code, env=bundle_env, cwd=cwd)
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(res.stdout.split())
    (before, after, source), (before2, after2, _) = runs
    # numba keys the cache on the kernels' source file: shipped as one, imported from it
    assert Path(source).is_absolute() and Path(source).is_file(), source
    assert (before, after) == ("False", "True"), runs
    assert (before2, after2) == ("True", "True"), runs


def test_app_opens_through_the_gui_entry_point(unpacked, bundle_env):
    exe = unpacked / "opt/flotilla/flotilla"
    res = _run(exe, "-c", "from importlib.metadata import entry_points as e; "
               "print([x.value for x in e(group='flotilla.gui')])", env=bundle_env, timeout=120)
    assert res.returncode == 0 and "app.main:run" in res.stdout, res.stderr
    # Plain `flotilla` opens the window (offscreen) and stays in the event loop.
    proc = subprocess.Popen([str(exe)], env=bundle_env, cwd=bundle_env["HOME"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        alive = proc.poll() is None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
    assert alive, f"the app exited with {proc.returncode}: {err[-3000:]}"
    assert "not installed" not in err and "Traceback" not in err, err[-3000:]


def test_demo_headless_from_the_bundle(unpacked, bundle_env):
    exe = unpacked / "opt/flotilla/flotilla"
    res = _run(exe, "demo", "--headless", env=bundle_env, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
