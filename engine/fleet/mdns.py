"""mDNS advertise/browse of `_flotilla._tcp.local.` (python-zeroconf).

Async core (AsyncZeroconf; `async_` methods run on the event loop) and a thin
sync wrapper that runs the core on a loop thread of its own.

Interfaces are a choice, not a given: None = every interface (what real users
get), or a list of interface names / IPv4 addresses. Tests pass the address of
their own namespace's veth, or 127.0.0.1, so no multicast leaves on a real NIC.

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
import threading
import time
from collections.abc import Sequence

import psutil
from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf
from zeroconf import ServiceInfo

from engine.fleet.discovery import Combined, Discovery, ManualPeers, Peer
from engine.fleet.txt import from_txt, to_txt
from engine.protocol.control import AgentInfo
from engine.protocol.errors import ProtocolError

log = logging.getLogger(__name__)
SERVICE_TYPE = "_flotilla._tcp.local."
DEFAULT_TTL_S = 60  # SRV/TXT/PTR/A TTL we announce (zeroconf's defaults are 120 s/75 min)
RESOLVE_TIMEOUT_MS = 3000


def resolve_interfaces(spec: Sequence[str] | None) -> list[str] | InterfaceChoice:
    """Interface names or IPv4 addresses -> IPv4 addresses for Zeroconf(interfaces=...).
    None or empty = all interfaces. An unknown name is an error, not a silent
    fallback to all (which would put multicast where the user did not want it)."""
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
    """Addresses to put in our A records: the chosen ones, or every non-loopback
    IPv4 address (loopback only when there is nothing else)."""
    if isinstance(interfaces, list):
        return interfaces
    ips = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
           if a.family == socket.AF_INET]
    public = [ip for ip in ips if not ipaddress.IPv4Address(ip).is_loopback]
    return public or ips


def open_zeroconf(interfaces: Sequence[str] | None) -> tuple[AsyncZeroconf, list[str]]:
    """An AsyncZeroconf on the chosen interfaces (IPv4; the fleet is a LAN
    thing and v4 keeps the test namespaces simple), and our addresses."""
    chosen = resolve_interfaces(interfaces)
    return AsyncZeroconf(interfaces=chosen, ip_version=IPVersion.V4Only), advertised_addresses(chosen)


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
    """Browses `_flotilla._tcp.local.`; resolves each instance to a Peer."""

    def __init__(self, interfaces: Sequence[str] | None = None, *, own_node_id: str | None = None,
                 azc: AsyncZeroconf | None = None) -> None:
        super().__init__()
        self.interfaces, self.own = interfaces, own_node_id
        self.azc, self._own_azc = azc, azc is None
        self._browser: AsyncServiceBrowser | None = None
        self._names: dict[str, str] = {}  # instance name -> node_id
        self._tasks: set[asyncio.Task] = set()

    async def async_start(self) -> None:
        if self.azc is None:
            self.azc, _ = open_zeroconf(self.interfaces)
        self._browser = AsyncServiceBrowser(self.azc.zeroconf, SERVICE_TYPE, handlers=[self._on_change])

    def _on_change(self, zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            node = self._names.pop(name, None)
            if node and node not in self._names.values():
                self._drop(node)
            return
        task = asyncio.get_running_loop().create_task(self._resolve(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, name: str) -> None:
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
        addrs = tuple(info.parsed_scoped_addresses(IPVersion.V4Only))
        if not addrs:
            return
        self._names[name] = agent.node_id
        self._set(Peer(agent, addrs, "mdns", time.time()))

    async def async_close(self) -> None:
        if self._browser is not None:
            await self._browser.async_cancel()
            self._browser = None
        for t in list(self._tasks):
            t.cancel()
        if self._own_azc and self.azc is not None:
            await self.azc.async_close()
            self.azc = None


class SyncDiscovery:
    """Thin sync wrapper: runs a Discovery on a private event loop thread.
    Listeners are called on that thread."""

    def __init__(self, discovery: Discovery) -> None:
        self.discovery = discovery
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flotilla-mdns", daemon=True)

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.discovery.async_start(), self._loop).result(10)

    def peers(self) -> dict[str, Peer]:
        return asyncio.run_coroutine_threadsafe(self._peers(), self._loop).result(10)

    async def _peers(self) -> dict[str, Peer]:
        return self.discovery.peers()

    def add_listener(self, listener) -> None:
        self._loop.call_soon_threadsafe(self.discovery.add_listener, listener)

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.discovery.async_close(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


# ------------------------------------------------ `python -m engine.fleet.mdns browse`


def peer_json(kind: str, peer: Peer) -> str:
    i = peer.info
    return json.dumps({"event": kind, "t": round(time.time(), 3), "node_id": i.node_id,
                       "host": i.hostname, "addresses": list(peer.addresses), "source": peer.source,
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
        asyncio.run(_browse(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
