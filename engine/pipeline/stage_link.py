"""StageLink: one stage of a ring as the coordinator sees it."""

from __future__ import annotations

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
