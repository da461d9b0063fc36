"""Linux idle time: systemd-logind's IdleHint of the graphical session (loginctl), then
X11 (`xprintidle` if installed, else XScreenSaverQueryInfo through ctypes/libXss).

Each source says whether it applies here (a session, a display: cheap to ask) apart
from reading it, so a headless box is told from a failed reading (engine/fleet/idle.py
FirstOf). _run() is the seam a test replaces with canned command output."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import time


def _run(cmd: list[str]) -> str:
    """stdout of cmd; OSError when it cannot run or exits non-zero."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=2)
    except subprocess.SubprocessError as e:
        raise OSError(f"{cmd[0]}: {e}") from e
    if r.returncode != 0:
        raise OSError(f"{cmd[0]} exited with {r.returncode}")
    return r.stdout


class LogindSource:
    """IdleHint/IdleSinceHint of the caller's session (XDG_SESSION_ID), else of the first
    graphical one. Looked up again on every applies() (a user may log in later)."""

    def __init__(self) -> None:
        self.session: str | None = None

    def applies(self) -> bool:
        if not shutil.which("loginctl"):
            return False
        self.session = os.environ.get("XDG_SESSION_ID") or self._graphical_session()
        return self.session is not None

    @staticmethod
    def _graphical_session() -> str | None:
        """None also when logind does not answer: installed but not running (a container,
        WSL without systemd) means no logind sessions, not a user we cannot see."""
        try:
            sessions = _run(["loginctl", "list-sessions", "--no-legend"]).splitlines()
        except OSError:
            return None
        for line in sessions:
            sid = line.split()[0] if line.split() else ""
            try:
                kind = _run(["loginctl", "show-session", sid, "-p", "Type", "--value"]).strip() if sid else ""
            except OSError:  # the session ended between the two calls
                continue
            if kind in ("x11", "wayland", "mir"):
                return sid
        return None

    def idle_seconds(self) -> float | None:
        if self.session is None:
            return None
        out = _run(["loginctl", "show-session", self.session, "-p", "IdleHint", "-p", "IdleSinceHint"])
        props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        if props.get("IdleHint") == "no":
            return 0.0
        if props.get("IdleHint") != "yes":
            return None  # no answer: unknown
        since_us = int(props.get("IdleSinceHint", "0") or 0)
        return max(0.0, time.time() - since_us / 1e6) if since_us else None


class X11Source:
    """Idle time of the X display: xprintidle, else libXss via ctypes."""

    class _Info(ctypes.Structure):
        _fields_ = [("window", ctypes.c_ulong), ("state", ctypes.c_int), ("kind", ctypes.c_int),
                    ("til_or_since", ctypes.c_ulong), ("idle", ctypes.c_ulong),
                    ("event_mask", ctypes.c_ulong)]

    def applies(self) -> bool:
        if not os.environ.get("DISPLAY"):
            return False
        return bool(shutil.which("xprintidle")
                    or (ctypes.util.find_library("X11") and ctypes.util.find_library("Xss")))

    def idle_seconds(self) -> float | None:
        if shutil.which("xprintidle"):
            out = _run(["xprintidle"]).strip()
            return int(out) / 1000.0 if out.isdigit() else None
        return self._xss()

    def _xss(self) -> float | None:
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
