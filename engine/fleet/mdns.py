"""mDNS advertise/browse of `_flotilla._tcp.local.` (python-zeroconf).

Async core (AsyncZeroconf; `async_` methods run on the event loop) and a thin
sync wrapper that runs the core on a loop thread of its own.

Interfaces are a choice, not a given: None = this machine's usable interfaces
(what real users get: addresses.announce_addresses skips WSL/Hyper-V, Docker,
VPN, host-only and link-local adapters), or a list of interface names / IPv4
addresses, used as given. Tests pass the address of their own namespace's veth,
or 127.0.0.1, so no multicast leaves on a real NIC.

A browser orders each peer's addresses best first (addresses.dial_order: same
subnet as one of ours first), dials them in turn on the info port
(discovery.async_dial) and lists the one that answered first; it remembers it and
asks that one first on the next TXT update (one quick question, no timeouts).

Stale peers: we advertise with short TTLs (DEFAULT_TTL_S), browsers refresh
live records before they expire, and zeroconf drops a record that was not
refreshed, which surfaces here as "removed". A clean stop says goodbye (TTL 0),
so it is removed at once.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import socket
import sys
import time
from collections.abc import Callable, Sequence

import psutil
import zmq
import zmq.asyncio
from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf
from zeroconf import ServiceInfo

from engine import aio
from engine.fleet import addresses as addr
from engine.fleet.discovery import DIAL_TIMEOUT_S, Combined, Discovery, ManualPeers, Peer, async_dial
from engine.fleet.txt import from_txt, to_txt
from engine.protocol.control import AgentInfo
from engine.protocol.errors import ProtocolError

log = logging.getLogger(__name__)
SERVICE_TYPE = "_flotilla._tcp.local."
DEFAULT_TTL_S = 60  # SRV/TXT/PTR/A TTL we announce (zeroconf's defaults are 120 s/75 min)
RESOLVE_TIMEOUT_MS = 3000


def resolve_interfaces(spec: Sequence[str] | None) -> list[str] | InterfaceChoice:
    """Interface names or IPv4 addresses -> IPv4 addresses for Zeroconf(interfaces=...).
    None or empty = InterfaceChoice.All (open_zeroconf narrows that to the usable
    ones). An unknown name is an error, not a silent fallback to all (which would put
    multicast where the user did not want it)."""
    if not spec:
        return InterfaceChoice.All
    by_name = psutil.net_if_addrs()
    out: list[str] = []
    for item in spec:
        try:
            out.append(str(ipaddress.IPv4Address(item)))
            continue
        except ValueError:
            pass
        addrs = [a.address for a in by_name.get(item, ()) if a.family == socket.AF_INET]
        if not addrs:
            raise ValueError(f"no IPv4 address on interface {item!r}")
        out.extend(addrs)
    return out


def advertised_addresses(interfaces: list[str] | InterfaceChoice) -> list[str]:
    """Addresses to put in our A records: the chosen ones as given, or this machine's
    usable IPv4 addresses (addresses.announce_addresses: virtual adapters and
    link-local only when there is nothing else, loopback only when nothing at all)."""
    if isinstance(interfaces, list):
        return interfaces
    return addr.announce_addresses(addr.nics())


def open_zeroconf(interfaces: Sequence[str] | None) -> tuple[AsyncZeroconf, list[str]]:
    """An AsyncZeroconf on the chosen interfaces (IPv4; the fleet is a LAN thing and
    v4 keeps the test namespaces simple), and our addresses. With no choice it runs
    on the addresses we announce, so no multicast goes into a VPN or a WSL network."""
    ours = advertised_addresses(resolve_interfaces(interfaces))
    return AsyncZeroconf(interfaces=ours, ip_version=IPVersion.V4Only), ours


class MdnsAdvertiser:
    """Announces one AgentInfo; async_update re-announces changed TXT."""

    def __init__(self, azc: AsyncZeroconf, addresses: Sequence[str], ttl: int = DEFAULT_TTL_S) -> None:
        self.azc, self.addresses, self.ttl = azc, list(addresses), ttl
        self._info: ServiceInfo | None = None
        self._pending: asyncio.Future | None = None  # the last announcement task

    def _service(self, info: AgentInfo) -> ServiceInfo:
        label = "".join(c if c.isalnum() or c == "-" else "-" for c in info.hostname)[:40] or "node"
        return ServiceInfo(
            SERVICE_TYPE, f"{label}-{info.node_id[:8]}.{SERVICE_TYPE}", port=info.control_port,
            properties=to_txt(info), server=f"flotilla-{info.node_id[:12]}.local.",
            parsed_addresses=self.addresses, host_ttl=self.ttl, other_ttl=self.ttl)

    async def async_register(self, info: AgentInfo) -> None:
        self._info = self._service(info)
        # The await probes for name conflicts (~0.75 s) and returns the task that
        # sends the announcements; we keep it rather than wait for all of them.
        self._pending = await self.azc.async_register_service(self._info, allow_name_change=True)

    async def async_update(self, info: AgentInfo) -> None:
        if self._info is None:
            return await self.async_register(info)
        new = self._service(info)
        new.name = self._info.name  # keep a name the conflict check may have changed
        self._info = new
        # Not awaited to the end: the repeats take seconds, and the agent's
        # housekeeping (yielding to the user) must not wait for them.
        self._pending = await self.azc.async_update_service(new)

    async def async_unregister(self) -> None:
        if self._info is not None:
            await (await self.azc.async_unregister_service(self._info))  # goodbye packets, sent
            self._info = None


class MdnsDiscovery(Discovery):
    """Browses `_flotilla._tcp.local.`; resolves each instance to a Peer whose
    addresses are dialed best first (module docstring). `own_nics` is this
    controller's interface table (addresses.nics; tests pass a fake one)."""

    def __init__(self, interfaces: Sequence[str] | None = None, *, own_node_id: str | None = None,
                 azc: AsyncZeroconf | None = None, own_nics: Callable[[], Sequence[addr.Nic]] = addr.nics,
                 dial_timeout: float = DIAL_TIMEOUT_S) -> None:
        super().__init__()
        self.interfaces, self.own = interfaces, own_node_id
        self.azc, self._own_azc = azc, azc is None
        self.own_nics, self.dial_timeout = own_nics, dial_timeout
        self._browser: AsyncServiceBrowser | None = None
        self._names: dict[str, str] = {}  # instance name -> node_id
        self._epoch: dict[str, int] = {}  # instance name -> count of its changes so far
        self._applied: dict[str, int] = {}  # instance name -> epoch of the resolve last applied
        self._removed: dict[str, int] = {}  # instance name -> epoch of its last removal
        self._reached: dict[str, str] = {}  # node_id -> the address that answered last
        self._tasks: set[asyncio.Task] = set()
        self._ctx: zmq.asyncio.Context | None = None

    async def async_start(self) -> None:
        if self.azc is None:
            self.azc, _ = open_zeroconf(self.interfaces)
        self._ctx = zmq.asyncio.Context()
        self._browser = AsyncServiceBrowser(self.azc.zeroconf, SERVICE_TYPE, handlers=[self._on_change])

    def _on_change(self, zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        self._epoch[name] = self._epoch.get(name, 0) + 1
        if state_change is ServiceStateChange.Removed:
            self._removed[name] = self._epoch[name]
            node = self._names.pop(name, None)
            if node and node not in self._names.values():
                self._reached.pop(node, None)
                self._drop(node)
            return
        task = asyncio.get_running_loop().create_task(self._resolve(name, self._epoch[name]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, name: str, epoch: int) -> None:
        assert self.azc is not None
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self.azc.zeroconf, RESOLVE_TIMEOUT_MS):
            log.debug("could not resolve %s", name)
            return
        try:
            agent = from_txt(info.properties)
        except ProtocolError as e:
            log.info("ignoring %s: %s", name, e)
            return
        if agent.node_id == self.own:
            return
        addrs = addr.dial_order(info.parsed_scoped_addresses(IPVersion.V4Only), self.own_nics())
        if not addrs:
            return
        reached = await self._reach(agent, addrs)
        # Resolves overlap (a TXT update while we dial): drop this one if the instance was
        # removed since it began, or a later one was applied already.
        if self._removed.get(name, 0) > epoch or self._applied.get(name, 0) > epoch:
            return
        self._applied[name] = epoch
        if reached is not None:
            addrs = [reached, *(a for a in addrs if a != reached)]
        self._names[name] = agent.node_id
        self._set(Peer(agent, tuple(addrs), "mdns", time.time(), reached=reached))

    async def _reach(self, agent: AgentInfo, addrs: list[str]) -> str | None:
        """The first of addrs to answer as this agent (None if none does), trying the one
        that answered last first: one quick question on a TXT update, and a cable pulled
        since then still falls back to the other addresses."""
        known = self._reached.get(agent.node_id)
        if known in addrs:
            addrs = [known, *(a for a in addrs if a != known)]
        if self._ctx is None:
            return None
        got = await async_dial(self._ctx, agent.node_id, addrs, agent.info_port, self.dial_timeout)
        if got is None:
            log.info("node %s: none of %s answers", agent.node_id[:8], ", ".join(addrs))
            self._reached.pop(agent.node_id, None)
            return None
        self._reached[agent.node_id] = got[0]
        return got[0]

    async def async_close(self) -> None:
        if self._browser is not None:
            await self._browser.async_cancel()
            self._browser = None
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._own_azc and self.azc is not None:
            await self.azc.async_close()
            self.azc = None


class SyncDiscovery:
    """Thin sync wrapper: runs a Discovery on a private event loop thread
    (aio.LoopThread). Listeners are called on that thread."""

    def __init__(self, discovery: Discovery) -> None:
        self.discovery = discovery
        self._thread = aio.LoopThread("flotilla-mdns")

    def start(self) -> None:
        self._thread.call(self.discovery.async_start(), timeout=10)

    def peers(self) -> dict[str, Peer]:
        return self._thread.call(self._peers(), timeout=10)

    async def _peers(self) -> dict[str, Peer]:
        return self.discovery.peers()

    def add_listener(self, listener) -> None:
        self._thread.call_soon(self.discovery.add_listener, listener)

    def close(self) -> None:
        try:
            if self._thread.running:
                self._thread.call(self.discovery.async_close(), timeout=10)
        finally:
            self._thread.stop(10)


# ------------------------------------------------ `python -m engine.fleet.mdns browse`


def peer_json(kind: str, peer: Peer) -> str:
    i = peer.info
    return json.dumps({"event": kind, "t": round(time.time(), 3), "node_id": i.node_id,
                       "host": i.hostname, "addresses": list(peer.addresses), "reached": peer.reached,
                       "source": peer.source,
                       "idle": i.idle, "ram_available": i.ram_available, "on_ac": i.on_ac,
                       "control_port": i.control_port, "fingerprint": i.fingerprint,
                       "devices": [d.name for d in i.devices]})


async def _browse(args: argparse.Namespace) -> None:
    parts: list[Discovery] = []
    if not args.no_mdns:
        parts.append(MdnsDiscovery(args.interface or None))
    if args.manual:
        parts.append(ManualPeers(None, entries=args.manual, interval=args.poll, misses=2))
    disc = Combined(*parts)
    disc.add_listener(lambda kind, peer: print(peer_json(kind, peer), flush=True))
    await disc.async_start()
    print(json.dumps({"event": "ready", "t": round(time.time(), 3)}), flush=True)
    try:
        if args.seconds:
            await asyncio.sleep(args.seconds)
        else:
            await asyncio.Event().wait()
    finally:
        await disc.async_close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.fleet.mdns",
                                description="print fleet peers as JSON lines as they come and go")
    p.add_argument("command", choices=["browse"])
    p.add_argument("--interface", action="append", default=[],
                   help="interface name or IPv4 address to use (repeatable; default: all)")
    p.add_argument("--manual", action="append", default=[], metavar="HOST:PORT",
                   help="also poll this agent directly (repeatable)")
    p.add_argument("--no-mdns", action="store_true", help="manual peers only")
    p.add_argument("--poll", type=float, default=1.0, help="manual peer poll interval, s")
    p.add_argument("--seconds", type=float, default=0, help="stop after this long (default: never)")
    args = p.parse_args(argv)
    try:
        aio.run(_browse(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
