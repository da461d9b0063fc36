"""How long the local user has been away from this machine.

An IdleSource answers idle_seconds(): seconds since the last keyboard/mouse
input, or None when it cannot tell. Platform sources, tried in order:

  Linux    logind IdleHint/IdleSinceHint of the graphical session (loginctl),
           then X11: `xprintidle` if installed, else XScreenSaverQueryInfo
           through ctypes (libXss)
  Windows  GetLastInputInfo (ctypes)
  macOS    HIDIdleTime from `ioreg -c IOHIDSystem`

A machine where none answers (a headless box: no session, no display) has no
local user to yield to; default_idle_source() then reports it idle since boot.
Tests inject FileIdleSource or FunctionIdleSource instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import psutil

log = logging.getLogger(__name__)


class IdleSource(Protocol):
    def idle_seconds(self) -> float | None:
        """Seconds since the last user input; None if unknown."""


class FunctionIdleSource:
    """Any callable as a source (tests, the tray app feeding its own figure)."""

    def __init__(self, fn: Callable[[], float | None]) -> None:
        self.fn = fn

    def idle_seconds(self) -> float | None:
        return self.fn()


class FileIdleSource:
    """The file holds the unix time of the last user input (a float). A test,
    or a script, writes time.time() there to say "the user is back"."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def idle_seconds(self) -> float | None:
        try:
            last = float(self.path.read_text().strip())
        except (OSError, ValueError):
            return None
        return max(0.0, time.time() - last)


class NoUserSource:
    """No local user at all: idle since boot."""

    def idle_seconds(self) -> float | None:
        return max(0.0, time.time() - psutil.boot_time())


class FirstOf:
    """The first source with an answer; a source that fails is skipped from
    then on (no loginctl fork every half second on a machine without it)."""

    def __init__(self, sources: Sequence[IdleSource]) -> None:
        self.sources = list(sources)

    def idle_seconds(self) -> float | None:
        for src in list(self.sources):
            try:
                value = src.idle_seconds()
            except Exception:
                log.debug("idle source %s failed", type(src).__name__, exc_info=True)
                value = None
            if value is not None:
                return value
            self.sources.remove(src)
        return None


def _run(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


class LogindSource:
    """systemd-logind's IdleHint of the caller's (or the first graphical) session."""

    def __init__(self) -> None:
        self.session = os.environ.get("XDG_SESSION_ID") or self._graphical_session()

    @staticmethod
    def _graphical_session() -> str | None:
        if not shutil.which("loginctl"):
            return None
        for line in (_run(["loginctl", "list-sessions", "--no-legend"]) or "").splitlines():
            sid = line.split()[0] if line.split() else ""
            kind = _run(["loginctl", "show-session", sid, "-p", "Type", "--value"]) if sid else None
            if kind and kind.strip() in ("x11", "wayland", "mir"):
                return sid
        return None

    def idle_seconds(self) -> float | None:
        if not self.session or not shutil.which("loginctl"):
            return None
        out = _run(["loginctl", "show-session", self.session, "-p", "IdleHint", "-p", "IdleSinceHint"])
        if not out:
            return None
        props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        if props.get("IdleHint") == "no":
            return 0.0
        since_us = int(props.get("IdleSinceHint", "0") or 0)
        return max(0.0, time.time() - since_us / 1e6) if since_us else None


class X11Source:
    """Idle time of the X display: xprintidle, else libXss via ctypes."""

    class _Info(ctypes.Structure):
        _fields_ = [("window", ctypes.c_ulong), ("state", ctypes.c_int), ("kind", ctypes.c_int),
                    ("til_or_since", ctypes.c_ulong), ("idle", ctypes.c_ulong),
                    ("event_mask", ctypes.c_ulong)]

    def idle_seconds(self) -> float | None:
        if not os.environ.get("DISPLAY"):
            return None
        if shutil.which("xprintidle"):
            out = _run(["xprintidle"])
            return int(out.strip()) / 1000.0 if out and out.strip().isdigit() else None
        xlib, xss = ctypes.util.find_library("X11"), ctypes.util.find_library("Xss")
        if not (xlib and xss):
            return None
        x11, lib = ctypes.cdll.LoadLibrary(xlib), ctypes.cdll.LoadLibrary(xss)
        x11.XOpenDisplay.restype = ctypes.c_void_p
        x11.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
        x11.XDefaultRootWindow.restype = ctypes.c_ulong
        lib.XScreenSaverAllocInfo.restype = ctypes.POINTER(self._Info)
        lib.XScreenSaverQueryInfo.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(self._Info)]
        display = x11.XOpenDisplay(None)
        if not display:
            return None
        try:
            info = lib.XScreenSaverAllocInfo()
            if not lib.XScreenSaverQueryInfo(display, x11.XDefaultRootWindow(display), info):
                return None
            return info.contents.idle / 1000.0
        finally:
            x11.XCloseDisplay.argtypes = [ctypes.c_void_p]
            x11.XCloseDisplay(display)


class WindowsSource:
    def idle_seconds(self) -> float | None:
        class LASTINPUTINFO(ctypes.Structure):
            _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]

        info = LASTINPUTINFO()
        info.cbSize = ctypes.sizeof(info)
        user32, kernel32 = ctypes.windll.user32, ctypes.windll.kernel32  # type: ignore[attr-defined]
        if not user32.GetLastInputInfo(ctypes.byref(info)):
            return None
        # Both are 32-bit millisecond tick counts; the mask handles the 49-day wrap.
        return ((kernel32.GetTickCount() - info.dwTime) & 0xFFFFFFFF) / 1000.0


class MacSource:
    def idle_seconds(self) -> float | None:
        out = _run(["ioreg", "-c", "IOHIDSystem", "-d", "4"])
        for line in (out or "").splitlines():
            if "HIDIdleTime" in line:
                return int(line.split("=")[-1].strip()) / 1e9
        return None


def default_idle_source() -> IdleSource:
    system = platform.system()
    if system == "Windows":
        chain: list[IdleSource] = [WindowsSource()]
    elif system == "Darwin":
        chain = [MacSource()]
    else:
        chain = [LogindSource(), X11Source()]
    return FirstOf([*chain, NoUserSource()])


def idle_source_from_spec(spec: str | None) -> IdleSource:
    """CLI form: None/"auto" = platform sources; "file:PATH"; "none" = no user."""
    if spec in (None, "", "auto"):
        return default_idle_source()
    if spec == "none":
        return NoUserSource()
    if spec.startswith("file:"):
        return FileIdleSource(spec[5:])
    raise ValueError(f"unknown idle source {spec!r} (auto, none or file:PATH)")
