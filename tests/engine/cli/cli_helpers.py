"""Helpers of the CLI tests: run `flotilla` as a user would, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def run_cli(*args: str, env_extra: dict[str, str] | None = None, timeout: float = 180,
            input: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["HF_HUB_OFFLINE"] = "1"
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "engine.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO, input=input)


def snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))} if root.exists() else {}
