"""One stage of a fleet ring as the launcher tracks it (_Stage), and its worker's handle:
RemoteWorker for a worker on an agent, _stop_local for one this PC started."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.fleet.bundle_view import BundleView
from engine.fleet.discovery import Peer
from engine.platform import process

LOCAL_STOP_GRACE_S = 2.0  # a local worker's graceful stop -> kill


@dataclass
class _Stage:
    index: int
    peer: Peer | None  # None = a local worker on this PC (a recovery's last resort)
    device: str
    start: int
    end: int
    bundle: BundleView | None = None  # the shard folder's bundle, read on the fly
    sha256: str = ""
    data_port: int = 0
    pid: int | None = None
    sent_bytes: int = 0  # bytes transferred (0 = the agent had it)
    shard_path: Path | None = None  # the exported shard folder on this PC
    link: Any = None  # its StageLink once wired
    proc: Any = None  # RemoteWorker (on an agent) or Popen (local)
    endpoint: str = ""  # local workers: the address they bound

    @property
    def host(self) -> str:
        return self.peer.info.hostname if self.peer is not None else "this PC"


class RemoteWorker:
    """A worker on an agent as StageLink.proc sees it: poll() is None until the
    agent reports that it stopped (yield, exit), so the coordinator notices at
    its next liveness check instead of after the ping timeout."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


def _stop_local(proc: Any) -> None:
    """Stop a worker this PC started (a RemoteWorker or None: nothing to do here)."""
    if proc is None or not isinstance(proc, subprocess.Popen):
        return
    process.stop(proc, LOCAL_STOP_GRACE_S)
