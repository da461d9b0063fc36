"""What differs between operating systems, kept in one place per concern.

Flotilla prefers one portable mechanism to an OS branch (engine/aio.py: one loop kind;
engine/platform/process.py: processes stopped through psutil, parents watched by pid and
creation time). Where a branch is unavoidable it lives in a module here, behind a small seam
that asks ``system()`` — which reads ``sys.platform`` on every call, so a test can fake the OS
with ``monkeypatch.setattr(sys, "platform", "win32")``.
"""

from __future__ import annotations

import sys

WINDOWS, MACOS, LINUX = "windows", "macos", "linux"


def system() -> str:
    """"windows", "macos" or "linux" (any other POSIX counts as linux)."""
    if sys.platform == "win32":
        return WINDOWS
    if sys.platform == "darwin":
        return MACOS
    return LINUX
