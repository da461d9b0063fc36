"""AgentConfig: what an agent is started with -- its folders, ports, mDNS, worker command,
idle source and lifelines (engine/fleet/agent.py runs it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.fleet.discovery import DEFAULT_BASE_PORT
from engine.fleet.idle import IdleSource
from engine.fleet.mdns import DEFAULT_TTL_S
from engine.fleet.paths import config_dir, data_dir
from engine.fleet.workers import pipeline_worker_command

POLL_S = 0.5  # machine poll; with the 0.6 s stop grace a yield takes < 2 s


@dataclass
class AgentConfig:
    config: Path = field(default_factory=config_dir)  # keys, node id, allow-list, policy
    data: Path = field(default_factory=data_dir)  # shards, logs
    bind: str = "*"  # address the three sockets bind ("*" = all)
    port: int = DEFAULT_BASE_PORT  # control port; pairing = +1, info = +2 (0 = any free ports)
    mdns: bool = True  # advertise over mDNS
    interfaces: Sequence[str] | None = None  # mDNS interfaces (names or IPv4); None = all
    mdns_ttl: int = DEFAULT_TTL_S  # TTL of our records; a dead agent vanishes after about this
    worker_command: Sequence[str] = field(default_factory=pipeline_worker_command)
    idle: IdleSource | None = None  # None = the platform's sources
    poll_s: float = POLL_S  # machine poll interval
    demo_auto_pair: bool = False  # `flotilla demo` only: accept its controller key unasked (demo_mode.py)
    stdin_lifeline: bool = False  # stop cleanly when stdin ends (started by the tray or the demo: a pipe)
    announce: Any = None  # a binary stream: once serving, the AgentUp line goes there (`--announce`)
