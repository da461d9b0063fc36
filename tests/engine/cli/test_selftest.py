"""`flotilla selftest`, the smoke test the Windows and macOS runners run (.github/workflows),
run here the same way: a subprocess, as a user types it. FLOTILLA_PORTABLE_IO=1 sends the MoE
and sparse reads through the portable positional reader, the path Windows takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from cli_helpers import REPO

STEPS = ["models", "agents", "find", "mdns", "pair", "status", "launch", "answer", "stop", "moe", "sparse",
         "cleanup"]


def _selftest(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(HF_HUB_OFFLINE="1", FLOTILLA_PORTABLE_IO="1")
    return subprocess.run([sys.executable, "-m", "engine.cli.main", "selftest", *args], capture_output=True,
                          text=True, encoding="utf-8", timeout=timeout, env=env, cwd=REPO)


def _our_temp_folders() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("flotilla-selftest-*"))


def _processes_using(folders: set[Path]) -> list[str]:
    """Processes whose command line names one of these folders (agents and shard workers do)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if any(str(f) in cmd for f in folders):
            out.append(f"{p.info['pid']}: {cmd[:200]}")
    return out


def test_selftest_passes_every_step_and_leaves_nothing_behind(demo_folder, tmp_path):
    before = _our_temp_folders()
    report = tmp_path / "selftest.json"
    res = _selftest("--json", str(report))
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("selftest: ")]
    assert [line.split()[2] for line in lines[:-1]] == STEPS and all(" ok " in line for line in lines[:-1])
    assert lines[-1].startswith(f"selftest: all {len(STEPS)} steps ok")
    steps = json.loads(report.read_text(encoding="utf-8"))
    assert steps["ok"] is True and [s["name"] for s in steps["steps"]] == STEPS
    made = _our_temp_folders() - before
    assert not made, f"temp folders left: {made}"
    root = Path(next(s for s in steps["steps"] if s["name"] == "cleanup")["detail"].split("removed ", 1)[1])
    assert not root.exists() and not _processes_using({root})


def test_a_failed_step_is_named_and_everything_is_stopped():
    """Agents that cannot come up in time: exit 1 naming the step; their processes and the temp
    folder are gone all the same."""
    before = _our_temp_folders()
    res = _selftest("--timeout", "0.001", timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "FAIL agents" in res.stdout and "selftest failed at step 'agents'" in res.stderr
    assert "Traceback" not in res.stderr
    made = _our_temp_folders() - before
    assert not made and not _processes_using(made | {Path(tempfile.gettempdir()) / "flotilla-selftest-"}), made


def test_selftest_help_names_every_step():
    res = subprocess.run([sys.executable, "-m", "engine.cli.main", "selftest", "--help"], capture_output=True,
                         text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    text = " ".join(res.stdout.split())  # argparse wraps lines
    assert res.returncode == 0 and "2 agents" in text and "MoE" in text and "--no-mdns" in text
