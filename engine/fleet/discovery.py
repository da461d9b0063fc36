"""The small discovery interface, and manual peers for networks without multicast.

A Discovery keeps a map node_id -> Peer and tells listeners about changes:
listener("added" | "updated" | "removed", peer). MdnsDiscovery (mdns.py) and
ManualPeers (here) implement it; Combined merges several (mDNS first).

Manual peers are "host:port" strings persisted in manual_peers.json, where
port is the agent's base port (its control port; pairing is base+1 and the
plaintext info port base+2). They are polled over the info port, which says
what the TXT record would.

A peer may announce several addresses (Ethernet and Wi-Fi, or one the controller
cannot reach). async_dial asks them in turn, best first (addresses.dial_order), and
a Peer lists the one that answered first: Peer.host / Peer.endpoint() is where to
connect, Peer.endpoints() every address for a caller that falls back itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import zmq
import zmq.asyncio

from engine.fleet.paths import read_json, write_json
from engine.protocol.codec import decode, encode
from engine.protocol.control import AgentInfo, InfoReply, InfoRequest
from engine.protocol.errors import ProtocolError

log = logging.getLogger(__name__)
MANUAL_FILE = "manual_peers.json"
DEFAULT_BASE_PORT = 47600
PAIR_OFFSET, INFO_OFFSET = 1, 2  # pairing and info ports relative to the base (control) port
DIAL_TIMEOUT_S = 1.0  # per address when dialing a peer's addresses in turn (a LAN answers in ms)

EventKind = Literal["added", "updated", "removed"]
Listener = Callable[[EventKind, "Peer"], None]


@dataclass(frozen=True)
class Peer:
    info: AgentInfo  # what the agent announced
    addresses: tuple[str, ...]  # where it can be reached, best first: the one that answered, if any
    source: Literal["mdns", "manual"]  # how we learnt of it
    last_seen: float  # unix time of the last announcement or answer
    reached: str | None = None  # the address that answered our info query; None: none did, or not dialed

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def host(self) -> str:
        """The address to use: the one that answered, else the best-ranked; "" if none."""
        return self.addresses[0] if self.addresses else ""

    def endpoint(self, port: int | None = None) -> str:
        """tcp:// endpoint of the best address (host), control port by default."""
        return _tcp(self.host, self.info.control_port if port is None else port)

    def endpoints(self, port: int | None = None) -> tuple[str, ...]:
        """tcp:// endpoints of every address, best first, for a caller that falls back
        to the next one itself (control port by default)."""
        return tuple(_tcp(a, self.info.control_port if port is None else port) for a in self.addresses)

    def same_host(self, other: Peer) -> bool:
        """Do both agents answer on one address (two agents on one PC)?"""
        return bool(self.addresses) and self.host == other.host


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Discovery(ABC):
    """node_id -> Peer, with change events. async_ methods run on the loop."""

    def __init__(self) -> None:
        self._peers: dict[str, Peer] = {}
        self._listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def peers(self) -> dict[str, Peer]:
        return dict(self._peers)

    @abstractmethod
    async def async_start(self) -> None: ...

    @abstractmethod
    async def async_close(self) -> None: ...

    def _set(self, peer: Peer) -> None:
        old = self._peers.get(peer.node_id)
        self._peers[peer.node_id] = peer
        if old is None:
            self._emit("added", peer)
        elif old.info != peer.info or old.addresses != peer.addresses:
            self._emit("updated", peer)

    def _drop(self, node_id: str) -> None:
        peer = self._peers.pop(node_id, None)
        if peer is not None:
            self._emit("removed", peer)

    def _emit(self, kind: EventKind, peer: Peer) -> None:
        for listener in list(self._listeners):
            try:
                listener(kind, peer)
            except Exception:  # one bad listener must not silence the others
                log.exception("discovery listener failed")


def parse_hostport(text: str, default_port: int = DEFAULT_BASE_PORT) -> tuple[str, int]:
    """'host', 'host:port', '[v6]:port' -> (host, port); ValueError otherwise."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"not a host[:port]: {text!r}")
    p = int(port) if port else default_port
    if not 1 <= p <= 65535 - INFO_OFFSET:
        raise ValueError(f"port out of range: {text!r}")
    return host, p


async def async_query_info(ctx: zmq.asyncio.Context, host: str, info_port: int,
                           timeout: float = 1.5) -> AgentInfo:
    """Ask an agent's plaintext info port for its AgentInfo. Raises
    TimeoutError, or ProtocolError for a bad answer."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        h = f"[{host}]" if ":" in host else host
        sock.connect(f"tcp://{h}:{info_port}")
        rid = uuid.uuid4().hex
        await sock.send(encode(InfoRequest(rid)))
        if not await sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no answer from {host}:{info_port}")
        reply = decode(await sock.recv())
        if not (isinstance(reply, InfoReply) and reply.request_id == rid):
            raise ProtocolError(f"unexpected answer {type(reply).__name__}")
        return reply.info
    finally:
        sock.close()


async def async_dial(ctx: zmq.asyncio.Context, node_id: str, addresses: Sequence[str], info_port: int,
                     timeout_each: float = DIAL_TIMEOUT_S) -> tuple[str, AgentInfo] | None:
    """Ask each address's info port in turn, best first, with a short timeout each; the
    first that answers *as node_id* wins (an address can lead to another agent: a
    subnet that exists on both PCs, our own WSL network). None if none did."""
    for host in addresses:
        try:
            info = await async_query_info(ctx, host, info_port, timeout=timeout_each)
        except (TimeoutError, ProtocolError, zmq.ZMQError, OSError) as e:
            log.debug("node %s not reached at %s: %s", node_id[:8], host, e)
            continue
        if info.node_id == node_id:
            return host, info
        log.info("%s:%d answers as node %s, not %s", host, info_port, info.node_id[:8], node_id[:8])
    return None


class ManualPeers(Discovery):
    """Peers added by hand, polled every `interval` s; removed after `misses`
    unanswered polls, back when they answer again (the entry stays)."""

    def __init__(self, config: Path | None, *, entries: list[str] | None = None,
                 interval: float = 5.0, misses: int = 3) -> None:
        super().__init__()
        self.path = config / MANUAL_FILE if config else None
        self.interval, self.misses = interval, misses
        self._entries: list[str] = list(entries or [])
        if self.path is not None:
            stored = read_json(self.path, [])
            self._entries += [e for e in stored if isinstance(e, str) and e not in self._entries]
        self._fails: dict[str, int] = {}
        self._by_entry: dict[str, str] = {}  # entry -> node_id
        self._task: asyncio.Task | None = None
        self._ctx: zmq.asyncio.Context | None = None

    def entries(self) -> list[str]:
        return list(self._entries)

    def add(self, entry: str) -> None:
        """Remember host:port (persisted); polled from the next round on."""
        host, port = parse_hostport(entry)
        norm = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if norm not in self._entries:
            self._entries.append(norm)
            self._save()
        if self._task is not None:
            asyncio.get_running_loop().create_task(self._poll(norm))

    def remove(self, entry: str) -> None:
        host, port = parse_hostport(entry)
        norm = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if norm in self._entries:
            self._entries.remove(norm)
            self._save()
        node = self._by_entry.pop(norm, None)
        if node:
            self._drop(node)

    def _save(self) -> None:
        if self.path is not None:
            write_json(self.path, self._entries)

    async def async_start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def async_close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._ctx:
            self._ctx.term()
            self._ctx = None

    async def _run(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(e) for e in list(self._entries)))
            await asyncio.sleep(self.interval)

    async def _poll(self, entry: str) -> None:
        assert self._ctx is not None
        host, port = parse_hostport(entry)
        try:
            info = await async_query_info(self._ctx, host, port + INFO_OFFSET)
        except (TimeoutError, ProtocolError, zmq.ZMQError, OSError) as e:
            self._fails[entry] = self._fails.get(entry, 0) + 1
            log.debug("manual peer %s: %s", entry, e)
            if self._fails[entry] >= self.misses and entry in self._by_entry:
                self._drop(self._by_entry.pop(entry))
            return
        self._fails[entry] = 0
        self._by_entry[entry] = info.node_id
        self._set(Peer(info, (host,), "manual", time.time(), reached=host))


class Combined(Discovery):
    """Several discoveries as one: the first source that knows a node wins
    (so an mDNS peer added by hand too is reported once)."""

    def __init__(self, *parts: Discovery) -> None:
        super().__init__()
        self.parts = parts
        for part in parts:
            part.add_listener(self._changed)

    def _changed(self, kind: EventKind, peer: Peer) -> None:
        for part in self.parts:
            best = part.peers().get(peer.node_id)
            if best is not None:
                self._set(best)
                return
        self._drop(peer.node_id)

    async def async_start(self) -> None:
        for part in self.parts:
            await part.async_start()

    async def async_close(self) -> None:
        for part in self.parts:
            await part.async_close()
