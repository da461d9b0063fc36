"""engine/fleet/discovery.py + mdns.py: a peer's addresses are dialed best first and the
one that answers as that peer is used (Peer.host / endpoint), over real sockets on
loopback (127.0.0.2-4 are loopback addresses too; mDNS runs on 127.0.0.1 only)."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import socket
import threading
import uuid

import zmq
import zmq.asyncio

from engine import aio
from engine.fleet.addresses import Nic
from engine.fleet.discovery import Discovery, Peer, async_dial
from engine.fleet.mdns import MdnsAdvertiser, MdnsDiscovery, SyncDiscovery, open_zeroconf
from engine.protocol.codec import decode, encode
from engine.protocol.control import AgentInfo, DeviceInfo, InfoReply, InfoRequest

NODE, OTHER = uuid.uuid4().hex, uuid.uuid4().hex  # unique: other tests' agents may announce on loopback too
LOOPBACK_ONLY = [Nic("lo", True, (ipaddress.IPv4Interface("127.0.0.1/8"),))]


def _info(node: str, info_port: int = 3, idle: bool = True) -> AgentInfo:
    return AgentInfo(node, "pc", "Linux", "0", 1, (DeviceInfo("CPU", ""),), 2 * 10**9, 10**9,
                     idle, None, True, info_port - 2, info_port - 1, info_port, "k" * 40, "0" * 16)


def _port_free_on(*hosts: str) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for h in hosts[1:]:
                with socket.socket() as t:
                    t.bind((h, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no common free port")


class InfoServer:
    """A plaintext info port answering as `node` on host:port; counts the questions."""

    def __init__(self, ctx: zmq.asyncio.Context, host: str, port: int, node: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(f"tcp://{host}:{port}")
        self.node, self.port, self.asked = node, port, 0
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            ident, raw = await self.sock.recv_multipart()
            req = decode(raw)
            assert isinstance(req, InfoRequest)
            self.asked += 1
            await self.sock.send_multipart([ident, encode(InfoReply(req.request_id, _info(self.node, self.port)))])

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sock.close()


def test_peer_endpoints_best_first():
    p = Peer(_info(NODE, 47602), ("192.168.1.5", "10.0.0.5", "fe80::1"), "mdns", 0.0, reached="192.168.1.5")
    assert p.host == "192.168.1.5" and p.endpoint() == "tcp://192.168.1.5:47600"
    assert p.endpoint(47601) == "tcp://192.168.1.5:47601"
    assert p.endpoints() == ("tcp://192.168.1.5:47600", "tcp://10.0.0.5:47600", "tcp://[fe80::1]:47600")
    same = dataclasses.replace(p, info=_info(OTHER, 47602))
    assert p.same_host(same) and not p.same_host(dataclasses.replace(same, addresses=("10.0.0.5",)))
    assert Peer(_info(NODE), (), "mdns", 0.0).host == ""


def test_dial_skips_silent_addresses_and_other_agents():
    async def main() -> None:
        port = _port_free_on("127.0.0.2", "127.0.0.3", "127.0.0.4")
        ctx = zmq.asyncio.Context()
        right, wrong = InfoServer(ctx, "127.0.0.2", port, NODE), InfoServer(ctx, "127.0.0.4", port, OTHER)
        try:
            got = await async_dial(ctx, NODE, ["127.0.0.3", "127.0.0.4", "127.0.0.2"], port, timeout_each=0.3)
            assert got is not None and got[0] == "127.0.0.2" and got[1].node_id == NODE
            assert wrong.asked == 1 and right.asked == 1  # the other agent was asked, and passed over
            assert await async_dial(ctx, NODE, ["127.0.0.3", "127.0.0.4"], port, timeout_each=0.2) is None
        finally:
            await right.close()
            await wrong.close()
            ctx.term()

    aio.run(main())


def test_mdns_peer_is_reached_through_the_address_that_answers():
    """The agent announces a silent address, another agent's, then its own; the browser
    lists the answering one first, and on a TXT update asks that one first."""

    async def main() -> None:
        port = _port_free_on("127.0.0.2", "127.0.0.3", "127.0.0.4")
        ctx = zmq.asyncio.Context()
        right, wrong = InfoServer(ctx, "127.0.0.2", port, NODE), InfoServer(ctx, "127.0.0.4", port, OTHER)
        azc, _ = open_zeroconf(["127.0.0.1"])
        adv = MdnsAdvertiser(azc, ["127.0.0.3", "127.0.0.4", "127.0.0.2"], ttl=10)
        # 2 s per address: the silent one costs that once per dial; shorter, a loaded machine's
        # slow answer from the right address would look like silence too.
        disc = MdnsDiscovery(["127.0.0.1"], own_nics=lambda: LOOPBACK_ONLY, dial_timeout=2.0)
        events: list[tuple[str, Peer]] = []
        disc.add_listener(lambda kind, peer: events.append((kind, peer)) if peer.node_id == NODE else None)
        try:
            await disc.async_start()
            await adv.async_register(_info(NODE, port))
            for _ in range(600):
                if events:
                    break
                await asyncio.sleep(0.05)
            kind, peer = events[0]
            assert kind == "added" and peer.node_id == NODE
            assert peer.reached == "127.0.0.2" and peer.host == "127.0.0.2"
            assert set(peer.addresses) == {"127.0.0.2", "127.0.0.3", "127.0.0.4"}
            assert peer.endpoint() == f"tcp://127.0.0.2:{port - 2}"
            asked, other_asked = right.asked, wrong.asked
            await adv.async_update(_info(NODE, port, idle=False))
            for _ in range(600):
                if any(k == "updated" for k, _ in events):
                    break
                await asyncio.sleep(0.05)
            kind, peer = events[-1]
            assert kind == "updated" and not peer.info.idle and peer.host == "127.0.0.2"
            assert right.asked > asked and wrong.asked == other_asked, \
                "a TXT update did not ask the address that answered last first"
        finally:
            await disc.async_close()
            await adv.async_unregister()
            await azc.async_close()
            await right.close()
            await wrong.close()
            ctx.term()

    aio.run(main())


class _Fake(Discovery):
    async def async_start(self) -> None:
        self._set(Peer(_info(NODE), ("10.0.0.1",), "manual", 0.0))

    async def async_close(self) -> None:
        self.closed = True


def test_sync_discovery_runs_on_its_own_loop_thread():
    fake = _Fake()
    sync = SyncDiscovery(fake)
    where: list[str] = []
    sync.add_listener(lambda kind, peer: where.append(threading.current_thread().name))
    sync.start()
    assert list(sync.peers()) == [NODE] and where == ["flotilla-mdns"]
    sync.close()
    assert fake.closed and not sync._thread.running
