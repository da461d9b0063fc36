"""Windows idle time: GetLastInputInfo (user32), the tick count of the session's last
input. ctypes.windll exists only on Windows, so it is reached lazily through _api(),
the seam a test replaces with fake functions."""

from __future__ import annotations

import ctypes
from typing import Any


class LASTINPUTINFO(ctypes.Structure):
    _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]


def _api() -> tuple[Any, Any]:
    """(user32, kernel32)."""
    windll = ctypes.windll  # type: ignore[attr-defined]  # Windows only
    return windll.user32, windll.kernel32


class WindowsSource:
    """Seconds since the last keyboard/mouse input of this session. The agent runs in
    the user's session (the tray app), where this is the owner's input."""

    def applies(self) -> bool:
        return True  # every Windows desktop has it; a failure is a failed reading, not "no user"

    def idle_seconds(self) -> float:
        user32, kernel32 = _api()
        info = LASTINPUTINFO()
        info.cbSize = ctypes.sizeof(info)
        if not user32.GetLastInputInfo(ctypes.byref(info)):
            raise OSError("GetLastInputInfo failed")
        # Both are 32-bit millisecond tick counts; the mask handles the 49.7-day wrap.
        return ((int(kernel32.GetTickCount()) - int(info.dwTime)) & 0xFFFFFFFF) / 1000.0
