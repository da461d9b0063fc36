"""StageLink: one stage of a ring as the coordinator sees it, and how a stage process's exit is told."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class StageLink:
    """One stage as the coordinator sees it."""

    index: int  # ring position
    start: int  # first layer (inclusive)
    end: int  # last layer (exclusive)
    endpoint: str  # the worker's bind address: control, and data for stage 0
    proc: Any = None  # a Popen-like (poll(), pid) when this side owns the process
    log_path: Path | None = None  # the worker's log, quoted when it crashes
    pid: int | None = None  # learnt from its pong when there is no proc
    server_key: str = ""  # the worker's CURVE public key (its agent's); "" = plaintext

    @property
    def label(self) -> str:
        pid = self.proc.pid if self.proc is not None else self.pid
        return f"stage {self.index} (layers {self.start}–{self.end}" + (f", pid {pid})" if pid else ")")


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"exited with signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exited with signal {-code}"
    return f"exited with code {code}"


def log_tail(path: Path | None, limit: int = 200) -> str:
    if path is None:
        return ""
    try:
        lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " ".join(lines[-1].split())[:limit] if lines else ""
