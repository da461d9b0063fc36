"""Where the fleet keeps its files, and how it writes them.

The folders are engine/paths.py's (one per kind, per OS, with $FLOTILLA_CONFIG /
$FLOTILLA_DATA overrides and the migration from earlier versions): config_dir() is its
keys folder (keys, node id, allow-list, policy, manual peers: small and secret), data_dir()
its data folder (shards, logs: big). With only $FLOTILLA_CONFIG set, data is
<FLOTILLA_CONFIG>/data, so a test or a second agent on one machine is isolated by one
variable.
"""

from __future__ import annotations

from pathlib import Path

from engine import paths as _paths
from engine.paths import ensure_private_dir, read_json, write_json, write_private

APP = _paths.APP


def config_dir() -> Path:
    """The fleet's config: engine.paths.keys_dir() (created, mode 0700)."""
    return _paths.keys_dir()


def data_dir() -> Path:
    """The fleet's shards and logs: engine.paths.data_dir() (created, mode 0700)."""
    return _paths.data_dir()


__all__ = ["APP", "config_dir", "data_dir", "ensure_private_dir", "read_json", "write_json", "write_private"]
