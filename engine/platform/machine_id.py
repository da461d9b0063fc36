"""The OS's own stable machine id: what survives a Wi-Fi MAC that rotates.

  Windows  MachineGuid in HKLM\\SOFTWARE\\Microsoft\\Cryptography (64-bit view)
  macOS    IOPlatformUUID of IOPlatformExpertDevice (ioreg)
  Linux    /etc/machine-id, else /var/lib/dbus/machine-id

machine_id() returns "" when there is none; it never raises (an odd machine must not
keep the agent from starting). _winreg() and _ioreg() are the seams a test replaces:
winreg exists only on Windows, so it is imported there, lazily.
"""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.platform import MACOS, WINDOWS, system

log = logging.getLogger(__name__)
LINUX_PATHS = ("/etc/machine-id", "/var/lib/dbus/machine-id")
CRYPTOGRAPHY_KEY = r"SOFTWARE\Microsoft\Cryptography"
_UUID = re.compile(r'"IOPlatformUUID"\s*=\s*"([^"]+)"')


def _winreg() -> Any:
    import winreg  # type: ignore[import-not-found]  # Windows only

    return winreg


def _ioreg() -> str:
    return subprocess.run(["ioreg", "-rd1", "-c", "IOPlatformExpertDevice"],
                          capture_output=True, text=True, timeout=5).stdout


def windows_machine_guid() -> str:
    reg = _winreg()
    # KEY_WOW64_64KEY: a 32-bit Python is otherwise redirected to WOW6432Node, which has no MachineGuid.
    with reg.OpenKey(reg.HKEY_LOCAL_MACHINE, CRYPTOGRAPHY_KEY, 0, reg.KEY_READ | reg.KEY_WOW64_64KEY) as key:
        return str(reg.QueryValueEx(key, "MachineGuid")[0]).strip()


def macos_platform_uuid() -> str:
    m = _UUID.search(_ioreg())
    return m.group(1).strip() if m else ""


def linux_machine_id(paths: Sequence[str] | None = None) -> str:
    for p in LINUX_PATHS if paths is None else paths:
        try:
            text = Path(p).read_text().strip()
        except OSError:
            continue
        if text and text != "uninitialized":  # systemd's first-boot placeholder
            return text
    return ""


def machine_id() -> str:
    """This OS's machine id, "" if unknown."""
    try:
        os_name = system()
        if os_name == WINDOWS:
            return windows_machine_guid()
        if os_name == MACOS:
            return macos_platform_uuid()
        return linux_machine_id()
    except Exception:
        log.debug("no machine id", exc_info=True)
        return ""
