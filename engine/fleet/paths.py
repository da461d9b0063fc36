"""Where the fleet keeps its files.

Config (keys, node id, allow-list, policy, manual peers) is small and secret:
$FLOTILLA_CONFIG, else the platform's user config dir. Data (shards, logs) is
big: $FLOTILLA_DATA, else <FLOTILLA_CONFIG>/data when only that is set (so a
test or a second agent on one machine is fully isolated by one variable), else
the platform's user data dir.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

APP = "flotilla"


def config_dir() -> Path:
    env = os.environ.get("FLOTILLA_CONFIG")
    if env:
        path = Path(env)
    else:
        import platformdirs

        path = Path(platformdirs.user_config_dir(APP, appauthor=False))
    return ensure_private_dir(path)


def data_dir() -> Path:
    env = os.environ.get("FLOTILLA_DATA")
    if env:
        path = Path(env)
    elif os.environ.get("FLOTILLA_CONFIG"):
        path = Path(os.environ["FLOTILLA_CONFIG"]) / "data"
    else:
        import platformdirs

        path = Path(platformdirs.user_data_dir(APP, appauthor=False))
    return ensure_private_dir(path)


def ensure_private_dir(path: Path) -> Path:
    """mkdir -p with mode 0700: other local users must not read our keys."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def write_private(path: Path, data: bytes | str) -> None:
    """Atomically replace path with data, mode 0600 from the first byte on
    (a temp file created 0600, then renamed): a crash leaves the old file or
    the new one, never half of one, and the secret is never world-readable."""
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o600) if hasattr(os, "fchmod") else None
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_json(path: Path, default: Any) -> Any:
    """The JSON in path, or default if it is missing or unreadable (a corrupt
    settings file must not keep the agent from starting; it is rewritten)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def write_json(path: Path, obj: Any) -> None:
    write_private(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
