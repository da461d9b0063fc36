"""Terminal progress for long work (demo build, download, export, compile).

Engines report progress as callbacks `(message, fraction)`; this turns them
into a one-line bar on a terminal, or into plain lines when stderr is a file
or a pipe (CI logs stay readable).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 24


class TerminalProgress:
    """A callable `(message, fraction in 0..1)` that draws a bar on stderr."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._out = stream or sys.stderr
        self._tty = self._out.isatty()
        self._last_message = ""
        self._last_draw = 0.0
        self._open_line = False

    def __call__(self, message: str, fraction: float) -> None:
        fraction = min(max(float(fraction), 0.0), 1.0)
        if not self._tty:
            # Plain lines: one per phase, not per tick.
            if message != self._last_message:
                self._out.write(f"{message}\n")
                self._out.flush()
            self._last_message = message
            return
        now = time.monotonic()
        if message == self._last_message and fraction < 1.0 and now - self._last_draw < 0.1:
            return
        filled = int(round(fraction * BAR_WIDTH))
        bar = "█" * filled + "·" * (BAR_WIDTH - filled)
        self._out.write(f"\r\033[K{bar} {fraction * 100:5.1f}%  {message}")
        if fraction >= 1.0:
            self._out.write("\n")
            self._open_line = False
        else:
            self._open_line = True
        self._out.flush()
        self._last_message, self._last_draw = message, now

    def close(self) -> None:
        if self._open_line:
            self._out.write("\n")
            self._out.flush()
            self._open_line = False
