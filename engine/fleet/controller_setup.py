"""The controller's side before a launch: its key pair, its address toward the agents,
finding agents (mDNS and manual host:port entries) and asking them to pair."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

from engine.fleet.client import async_pair
from engine.fleet.discovery import Combined, Discovery, ManualPeers, Peer
from engine.transport.security import KeyPair


def controller_keys(config: Path | None = None) -> KeyPair:
    """This PC's CurveZMQ key pair (the same node key its agent uses)."""
    from engine.fleet.paths import config_dir, ensure_private_dir

    return KeyPair.load_or_create(ensure_private_dir(config) if config else config_dir())


def local_address_toward(host: str) -> str:
    """Our address on the route to host (no packet is sent: a UDP connect only)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


# ---------------------------------------------------------------- discovery and pairing


async def async_discover(interfaces: Sequence[str] | None, *, want: int | None = None,
                         keys: set[str] | None = None, manual: Sequence[str] = (),
                         timeout: float = 10.0, settle: float = 0.5) -> list[Peer]:
    """Agents found over mDNS (on these interfaces; None = all) and manual
    host:port entries. With keys, only agents with those public keys count;
    returns once `want` of them are found (or all of keys), else at timeout."""
    from engine.fleet.mdns import MdnsDiscovery

    parts: list[Discovery] = [MdnsDiscovery(interfaces)]
    if manual:
        parts.append(ManualPeers(None, entries=list(manual), interval=0.5))
    disc = Combined(*parts)
    await disc.async_start()
    goal = want if want is not None else (len(keys) if keys else None)
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            found = [p for p in disc.peers().values() if keys is None or p.info.public_key in keys]
            if goal is not None and len(found) >= goal:
                break
            await asyncio.sleep(0.1)
        if goal is None:
            await asyncio.sleep(settle)
        found = [p for p in disc.peers().values() if keys is None or p.info.public_key in keys]
    finally:
        await disc.async_close()
    return sorted(found, key=lambda p: p.node_id)


async def async_pair_all(keys: KeyPair, peers: Sequence[Peer], name: str, *, wait: float = 0.0,
                         on_code: Callable[[Peer, str], None] | None = None) -> dict[str, str]:
    """Ask every peer to pair; node_id -> state ("accepted" / "pending").
    on_code(peer, code) shows the code the owner must see on the agent."""
    from engine.transport.security import pairing_code

    async def one(peer: Peer) -> str:
        if on_code:
            on_code(peer, pairing_code(peer.info.public_key, keys.public))
        reply = await async_pair(keys, peer.endpoint(peer.info.pair_port), peer.info.public_key, name,
                                 wait=wait)
        return reply.state

    states = await asyncio.gather(*(one(p) for p in peers))
    return {p.node_id: s for p, s in zip(peers, states)}
