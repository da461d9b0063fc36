"""The app's own preferences (theme, API server, data folder): a small JSON
file, app_settings.json in the settings folder (engine.client.settings_dir(), engine/paths.py).

Plain Python; read once at start, written on every change (atomically, so a
crash never leaves half a file)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

FILE = "app_settings.json"


@dataclass
class AppSettings:
    theme: str = "system"  # "light" | "dark" | "system"
    api_enabled: bool = False  # serve the current engine on 127.0.0.1
    api_port: int = 8000  # the local API server's port
    data_folder: str = ""  # conversations live here ("" = default; $FLOTILLA_DATA wins)
    last_model: str = "demo"  # opened at start: the demo needs no set-up
    fleet_interfaces: str = ""  # mDNS discovery: "" = all interfaces, else comma-separated names/IPv4s

    @classmethod
    def load(cls, folder: Path) -> "AppSettings":
        try:
            raw = json.loads((folder / FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return cls()
        names = {f.name for f in fields(cls)}
        out = cls()
        for k, v in (raw.items() if isinstance(raw, dict) else ()):
            if k in names and isinstance(v, type(getattr(out, k))):
                setattr(out, k, v)
        return out

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".app_settings.", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(self), f, indent=2)
        os.replace(tmp, folder / FILE)
