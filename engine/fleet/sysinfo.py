"""Facts about this machine for announcements: host, OS, RAM, power, devices."""

from __future__ import annotations

import logging
import os
import platform
import socket
import threading

import psutil

from engine.platform import MACOS, WINDOWS, system
from engine.protocol.control import DeviceInfo

log = logging.getLogger(__name__)
_devices: tuple[DeviceInfo, ...] | None = None
_devices_lock = threading.Lock()


def hostname() -> str:
    return socket.gethostname()[:255]


def os_name() -> str:
    """What people call this OS: "Windows 11", "macOS 14.5", "Linux 6.8.0-45-generic"."""
    os_ = system()
    if os_ == WINDOWS:
        # platform.release() says "10" on Windows 11 before Python 3.12: the build number tells them apart.
        build = platform.version().split(".")[-1]
        name = "Windows 11" if build.isdigit() and int(build) >= 22000 else f"Windows {platform.release()}"
    elif os_ == MACOS:
        name = f"macOS {platform.mac_ver()[0] or platform.release()}"  # release() is the Darwin kernel's
    else:
        name = f"{platform.system()} {platform.release()}"
    return name[:255]


def ram() -> tuple[int, int]:
    """(total, available) bytes."""
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


def on_ac() -> bool | None:
    """Mains power? A machine without a battery is on AC; None if unknown."""
    try:
        battery = psutil.sensors_battery()
    except Exception:  # some platforms raise instead of returning None
        return None
    return True if battery is None else bool(battery.power_plugged) \
        if battery.power_plugged is not None else None


def openvino_devices() -> tuple[DeviceInfo, ...]:
    """OpenVINO devices with their full names. Importing openvino and querying
    plugins takes ~0.5 s (seconds with a GPU driver), so it runs once, lazily,
    and the answer is cached for the life of the process.
    FLOTILLA_FLEET_DEVICES="CPU=Name;GPU.0=Name" overrides it (tests, and
    machines where a plugin hangs)."""
    global _devices
    with _devices_lock:
        if _devices is None:
            _devices = _query_devices()
        return _devices


def _query_devices() -> tuple[DeviceInfo, ...]:
    override = os.environ.get("FLOTILLA_FLEET_DEVICES")
    if override is not None:
        out = []
        for item in filter(None, override.split(";")):
            name, _, full = item.partition("=")
            out.append(DeviceInfo(name.strip(), full.strip()[:255]))
        return tuple(out)
    try:
        import openvino

        core = openvino.Core()
        out = []
        for name in core.available_devices[:32]:
            try:
                full = str(core.get_property(name, "FULL_DEVICE_NAME"))
            except Exception:
                full = ""
            out.append(DeviceInfo(name, full[:255]))
        return tuple(out)
    except Exception:
        log.warning("could not list OpenVINO devices; announcing CPU only", exc_info=True)
        return (DeviceInfo("CPU", platform.processor()[:255]),)
