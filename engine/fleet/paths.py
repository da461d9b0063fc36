"""Where the fleet keeps its files, and how it writes them.

The folders are engine/paths.py's (one per kind, per OS, with $FLOTILLA_CONFIG /
$FLOTILLA_DATA overrides and the migration from earlier versions): config_dir() is its
keys folder (keys, node id, allow-list, policy, manual peers: small and secret), data_dir()
its data folder (shards, logs: big). With only $FLOTILLA_CONFIG set, data is
<FLOTILLA_CONFIG>/data, so a test or a second agent on one machine is isolated by one
variable.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from engine import paths as _paths
from engine.paths import ensure_private_dir

APP = _paths.APP


def config_dir() -> Path:
    """The fleet's config: engine.paths.keys_dir() (created, mode 0700)."""
    return _paths.keys_dir()


def data_dir() -> Path:
    """The fleet's shards and logs: engine.paths.data_dir() (created, mode 0700)."""
    return _paths.data_dir()


__all__ = ["APP", "config_dir", "data_dir", "ensure_private_dir", "read_json", "write_json", "write_private"]


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
