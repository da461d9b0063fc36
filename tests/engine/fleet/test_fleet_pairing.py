"""Pairing and the CURVE gate, against a real agent process on loopback.

A paired controller drives the agent (status, prepare, load = a real child
process); an unpaired or wrong key is refused before any byte reaches the
agent's parser; captured bytes replayed on a new connection, and a tampered
message on a live one, are rejected by CURVE; a re-used request_id is
rejected by our own layer."""

from __future__ import annotations

import asyncio
import hashlib
import os

import psutil
import pytest
import zmq
import zmq.asyncio

from engine.fleet.client import AgentClient, AgentRefused, FleetError, NotPaired, sha256_file
from engine.fleet.policy import SharingPolicy
from engine.planner.plan import RUNTIME_RESERVE_BYTES
from engine.transport.security import KeyPair, curve_client
from engine.protocol.codec import decode, encode
from engine.protocol.control import LoadRequest, StatusRequest
from engine.protocol.errors import Refusal
from engine.protocol.messages import ErrorReply
from tests.engine.fleet.fleet_helpers import AgentProc, free_port, pair, process_gone


@pytest.fixture
def agent(tmp_path):
    a = AgentProc(tmp_path).start()
    yield a
    a.stop()


async def _ask_worker(port: int) -> bytes:
    ctx = zmq.asyncio.Context()
    s = ctx.socket(zmq.REQ)
    s.linger = 0
    s.connect(f"tcp://127.0.0.1:{port}")
    try:
        for _ in range(50):  # the child may still be binding
            await s.send(b"hello")
            if await s.poll(200):
                return await s.recv()
            s.close(0)
            s = ctx.socket(zmq.REQ)
            s.linger = 0
            s.connect(f"tcp://127.0.0.1:{port}")
        raise AssertionError("worker never answered")
    finally:
        s.close(0)
        ctx.term()


def test_paired_controller_drives_agent_unpaired_refused(agent, tmp_path):
    async def main():
        me = KeyPair.generate()
        # Before pairing: the control socket's ZAP refuses the key.
        with pytest.raises(NotPaired, match="not paired"):
            await AgentClient(me, agent.control, agent.public_key, timeout=5).async_connect()
        # A wrong code is refused by the CLI; nothing is added.
        bad = await asyncio.to_thread(agent.cli, "pair", "--accept", "000000")
        assert bad.returncode == 1 and "no pending pairing request" in bad.stderr
        await pair(agent, me)
        listing = await asyncio.to_thread(agent.cli, "pair", "--list")
        assert "paired" in listing.stdout and "test-controller" in listing.stdout

        client = await AgentClient(me, agent.control, agent.public_key).async_connect()
        try:
            st = await client.status()
            assert st.sharing and st.info.public_key == agent.public_key
            shard = tmp_path / "shard.bin"
            shard.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
            sha = sha256_file(shard)
            prep = await client.prepare("demo/L0-4", sha, shard.stat().st_size)
            assert not prep.cached and prep.have_bytes == 0
            done = await client.send_shard(shard, "demo/L0-4", sha=sha)
            assert done.complete
            assert (await client.prepare("demo/L0-4", sha, shard.stat().st_size)).cached
            port = free_port()
            loaded = await client.load(sha, "CPU", port)
            pid = loaded.shard.pid
            assert loaded.shard.state == "running" and pid
            # A real child of the agent that read the verified shard.
            assert psutil.Process(pid).ppid() == agent.proc.pid
            assert await _ask_worker(port) == f"ready {sha} CPU".encode()
            st = await client.status()
            assert [s.state for s in st.shards if s.sha256 == sha] == ["running"]
            # Policy: a device family the owner did not share is refused, the reason in fields.
            with pytest.raises(AgentRefused, match="not shared") as no:
                await client.load(sha, "NPU", 0)
            assert no.value.code == "refused" and no.value.refusal == Refusal("device")
            gone = await client.unload(sha)
            assert gone.shard.state == "exited"
            assert process_gone(pid)
            # The owner lowers the RAM cap for fleet work below this worker: refused with the bytes.
            SharingPolicy(max_cpu_percent_to_start=100.0, devices=("CPU", "GPU"), max_ram_gb=0.001).save(agent.config)
            for _ in range(100):  # the agent reloads its policy on its next beat
                if (await client.status()).info.ram_available <= 1_000_000:
                    break
                await asyncio.sleep(0.1)
            with pytest.raises(AgentRefused) as cap:
                await client.load(sha, "CPU", free_port())
            assert cap.value.code == "refused"
            assert cap.value.refusal == Refusal("policy_cap", shard.stat().st_size + RUNTIME_RESERVE_BYTES, 1_000_000)
            assert "RAM limit of 0.001 GB" in cap.value.reply.message
            assert [s.state for s in (await client.status()).shards if s.sha256 == sha] == ["exited"]  # none started
        finally:
            client.close()

        # Another key (never paired) is refused too, and so is the right client
        # key with a wrong agent key (the handshake cannot even be decrypted).
        with pytest.raises(NotPaired):
            await AgentClient(KeyPair.generate(), agent.control, agent.public_key,
                              timeout=5).async_connect()
        with pytest.raises(FleetError, match="wrong agent key"):
            await AgentClient(me, agent.control, KeyPair.generate().public, timeout=5).async_connect()

        # The pairing port answers only PairRequest, whoever asks.
        ctx = zmq.asyncio.Context()
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        curve_client(s, KeyPair.generate(), agent.public_key)
        s.connect(agent.pairing)
        await s.send(encode(StatusRequest("x1")))
        reply = decode(await asyncio.wait_for(s.recv(), 5))
        assert isinstance(reply, ErrorReply) and reply.code == "not_paired"
        s.close(0)

        # Our own layer: the same request_id twice from one key is a replay.
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        curve_client(s, me, agent.public_key)
        s.connect(agent.control)
        raw = encode(StatusRequest("same-id"))
        await s.send(raw)
        assert type(decode(await asyncio.wait_for(s.recv(), 5))).__name__ == "StatusReply"
        await s.send(raw)
        again = decode(await asyncio.wait_for(s.recv(), 5))
        assert isinstance(again, ErrorReply) and "replay" in again.message
        s.close(0)

        # Revocation: an open connection is refused from the next message on.
        client = await AgentClient(me, agent.control, agent.public_key).async_connect()
        out = await asyncio.to_thread(agent.cli, "pair", "--revoke", "test-controller")
        assert out.returncode == 0, out.stderr
        with pytest.raises(NotPaired):
            await client.status()
        client.close()
        with pytest.raises(NotPaired):
            await AgentClient(me, agent.control, agent.public_key, timeout=5).async_connect()
        ctx.term()

    asyncio.run(main())
    assert agent.proc.poll() is None
    assert any("refused control connection from unpaired key" in line for line in agent.lines)


class _Proxy:
    """A loopback TCP proxy that records client->agent bytes and can flip one
    byte of the next client->agent packet (a man in the middle)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.recorded = bytearray()
        self.tamper_next = False

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _conn(self, r, w) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src, dst, record):
            try:
                while data := await src.read(65536):
                    if record:
                        if self.tamper_next and len(data) > 40:
                            data = data[:-5] + bytes([data[-5] ^ 0x01]) + data[-4:]
                            self.tamper_next = False
                        self.recorded += data
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(r, uw, True), pipe(ur, w, False))

    def close(self) -> None:
        self.server.close()


def test_replayed_and_tampered_traffic_is_rejected(agent, tmp_path):
    async def main():
        me = KeyPair.generate()
        await pair(agent, me)
        shard = tmp_path / "s.bin"
        shard.write_bytes(os.urandom(100_000))
        sha = hashlib.sha256(shard.read_bytes()).hexdigest()

        proxy = _Proxy(agent.base)
        pport = await proxy.start()
        client = await AgentClient(me, f"tcp://127.0.0.1:{pport}", agent.public_key).async_connect()
        await client.send_shard(shard, "s")
        loaded = await client.load(sha, "CPU", free_port())
        await client.unload(sha)
        client.close()
        await asyncio.sleep(0.2)
        captured = bytes(proxy.recorded)
        assert len(captured) > 100_000

        # 1. Replay the whole captured client stream on a fresh TCP connection.
        #    The server answers the (replayable) greeting and HELLO, then the
        #    old INITIATE's cookie does not open under this connection's key:
        #    it hangs up. The LoadRequest in the capture never runs again.
        r, w = await asyncio.open_connection("127.0.0.1", agent.base)
        w.write(captured)
        await w.drain()
        got = bytearray()
        try:
            while chunk := await asyncio.wait_for(r.read(65536), 5):
                got += chunk
        except (ConnectionError, asyncio.TimeoutError):
            pass
        w.close()
        assert len(got) < 400, "the agent sent more than its greeting and WELCOME"
        assert b"load_reply" not in got and b"status_reply" not in got

        # 2. Tamper with one byte of a live, authenticated connection.
        client = await AgentClient(me, f"tcp://127.0.0.1:{pport}", agent.public_key,
                                   timeout=3).async_connect()
        await client.status()
        proxy.tamper_next = True
        with pytest.raises(FleetError, match="no reply"):
            await client.chan.request(LoadRequest("tampered-1", sha, "CPU", 0), object)
        client.close()
        proxy.close()

        # The agent is fine, and neither the replay nor the tampered Load started a worker.
        client = await AgentClient(me, agent.control, agent.public_key).async_connect()
        st = await client.status()
        assert [s.state for s in st.shards if s.sha256 == sha] == ["exited"]
        client.close()
        return loaded.shard.pid

    first_pid = asyncio.run(main())
    started = [line for line in agent.lines if "started worker pid" in line]
    assert len(started) == 1 and str(first_pid) in started[0]
    assert agent.proc.poll() is None
