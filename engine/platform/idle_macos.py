"""macOS idle time: HIDIdleTime (nanoseconds since the last input event) from
`ioreg -c IOHIDSystem`. _ioreg() is the seam a test replaces with canned output."""

from __future__ import annotations

import re
import shutil
import subprocess

_HID_IDLE = re.compile(r'"HIDIdleTime"\s*=\s*(\d+)')


def _ioreg() -> str:
    r = subprocess.run(["ioreg", "-c", "IOHIDSystem", "-d", "4"], capture_output=True, text=True, timeout=2)
    if r.returncode != 0:
        raise OSError(f"ioreg exited with {r.returncode}")
    return r.stdout


class MacSource:
    def applies(self) -> bool:
        return shutil.which("ioreg") is not None

    def idle_seconds(self) -> float:
        m = _HID_IDLE.search(_ioreg())
        if m is None:
            raise OSError("no HIDIdleTime in ioreg's output")
        return int(m.group(1)) / 1e9
