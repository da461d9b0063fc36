"""A 50 MB shard: interrupted midway (the agent is killed), resumed from where
it stopped after a restart, verified by SHA-256; a corrupted chunk and a
corrupted partial file are caught."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from engine.fleet.client import AgentClient, AgentRefused, sha256_file
from engine.transport.security import KeyPair
from engine.protocol.control import ChunkReply, ChunkRequest
from tests.engine.fleet.fleet_helpers import AgentProc, pair

SIZE = 50 * 1024 * 1024
CHUNK = 1024 * 1024


def test_50mb_transfer_resumes_after_interruption(tmp_path):
    shard = tmp_path / "big.bin"
    with open(shard, "wb") as f:
        for _ in range(SIZE // CHUNK):
            f.write(os.urandom(CHUNK))
    sha = sha256_file(shard)
    me = KeyPair.generate()
    agent = AgentProc(tmp_path).start()
    try:
        async def first() -> int:
            await pair(agent, me)
            client = await AgentClient(me, agent.control, agent.public_key).async_connect()
            try:
                last = await client.send_shard(shard, "big/L0-8", sha=sha, chunk=CHUNK, max_chunks=23)
                assert isinstance(last, ChunkReply) and not last.complete
                # A chunk whose bytes do not match its hash never lands on disk.
                bad = ChunkRequest("bad-chunk", sha, last.have_bytes, b"x" * 10,
                                   hashlib.sha256(b"y").hexdigest())
                with pytest.raises(AgentRefused, match="chunk sha256 mismatch"):
                    await client.chan.request(bad, ChunkReply)
                return last.have_bytes
            finally:
                client.close()

        have = asyncio.run(first())
        assert have == 23 * CHUNK
        agent.stop(kill=True)  # the interruption: SIGKILL, no chance to tidy up
        part = agent.config / "data" / "shards" / f"{sha}.part"
        assert part.stat().st_size == have

        agent = AgentProc(tmp_path, base=agent.base).start()

        async def resume() -> tuple[int, int, bool]:
            client = await AgentClient(me, agent.control, agent.public_key).async_connect()
            try:
                prep = await client.prepare("big/L0-8", sha, SIZE)
                sent = []
                done = await client.send_shard(shard, "big/L0-8", sha=sha, chunk=CHUNK,
                                               progress=lambda n, total: sent.append(n))
                return prep.have_bytes, len(sent), done.complete
            finally:
                client.close()

        resumed_from, chunks, complete = asyncio.run(resume())
        assert resumed_from == have  # not from zero
        assert chunks == (SIZE - have) // CHUNK  # only the missing part crossed the wire
        assert complete
        cached = agent.config / "data" / "shards" / sha
        assert cached.stat().st_size == SIZE and sha256_file(cached) == sha
        assert not part.exists()
    finally:
        agent.stop()


def test_corrupted_partial_is_caught_and_discarded(tmp_path):
    data = os.urandom(3 * CHUNK)
    shard = tmp_path / "s.bin"
    shard.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    me = KeyPair.generate()
    agent = AgentProc(tmp_path).start()
    try:
        async def go():
            await pair(agent, me)
            c = await AgentClient(me, agent.control, agent.public_key).async_connect()
            await c.send_shard(shard, "s", sha=sha, chunk=CHUNK, max_chunks=2)
            c.close()

        asyncio.run(go())
        agent.stop()
        part = agent.config / "data" / "shards" / f"{sha}.part"
        raw = bytearray(part.read_bytes())
        raw[1000] ^= 0xFF  # bit rot (or an attacker with disk access) while it was down
        part.write_bytes(bytes(raw))
        agent = AgentProc(tmp_path, base=agent.base).start()

        async def resume():
            c = await AgentClient(me, agent.control, agent.public_key).async_connect()
            try:
                with pytest.raises(AgentRefused, match="shard sha256 mismatch"):
                    await c.send_shard(shard, "s", sha=sha, chunk=CHUNK)
                assert (await c.prepare("s", sha, len(data))).have_bytes == 0  # discarded
                assert (await c.send_shard(shard, "s", sha=sha, chunk=CHUNK)).complete
            finally:
                c.close()

        asyncio.run(resume())
    finally:
        agent.stop()
