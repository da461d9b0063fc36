"""10 000 malformed or random control messages against a live agent: every
one gets an ErrorReply, the agent keeps serving, and its memory stays flat."""

from __future__ import annotations

import asyncio
import random

import msgpack
import psutil
import zmq
import zmq.asyncio

from engine.transport.security import KeyPair, curve_client
from engine.protocol.codec import decode, encode
from engine.protocol.control import InfoReply, InfoRequest, StatusReply, StatusRequest
from engine.protocol.messages import ErrorReply
from engine.protocol.version import PROTOCOL_VERSION
from tests.engine.fleet.fleet_helpers import AgentProc, pair

KINDS = ["status_request", "prepare_request", "chunk_request", "load_request", "unload_request",
         "stop_request", "pair_request", "info_request", "agent_info", "nope", ""]
SHA = "ab" * 32


def _junk(rng: random.Random, i: int) -> list[bytes]:
    """One hostile message (as frames), from a mix of families."""
    fam = i % 8
    if fam == 0:  # random bytes
        return [rng.randbytes(rng.randint(0, 300))]
    if fam == 1:  # random msgpack values
        return [msgpack.packb(rng.choice([None, 1, -5, 2.5, "x" * rng.randint(0, 50), [1, 2], {"a": 1},
                                          {"v": 1}, b"\x00" * 10]))]
    if fam == 2:  # envelopes with wrong versions or kinds
        return [msgpack.packb({"v": rng.choice([0, 2, -1, "1", None, PROTOCOL_VERSION]),
                               "k": rng.choice(KINDS), "b": {}})]
    if fam == 3:  # right envelope, hostile bodies
        body = rng.choice([
            {"request_id": ""}, {"request_id": "r" * 500}, {"request_id": 5},
            {"request_id": "ok", "extra": 1},
            {"request_id": "ok", "shard_id": "x", "sha256": "zz", "size": -1},
            {"request_id": "ok", "shard_id": "../../etc/passwd", "sha256": SHA, "size": 2**62},
            {"request_id": "ok", "sha256": SHA, "offset": 0, "data": b"", "chunk_sha256": SHA},
            {"request_id": "ok", "sha256": SHA, "device": "CPU; rm -rf /", "data_port": 1},
            {"request_id": "ok", "sha256": SHA, "device": "CPU", "data_port": 70000},
            {"request_id": "ok", "shutdown": "yes"}])
        return [msgpack.packb({"v": PROTOCOL_VERSION, "k": rng.choice(KINDS[:6]), "b": body})]
    if fam == 4:  # several frames, or an empty one
        return [b"", b"x"] if rng.random() < 0.5 else [encode(StatusRequest(f"m{i}"))] * 2
    if fam == 5:  # truncated valid message
        raw = encode(StatusRequest(f"t{i}"))
        return [raw[: rng.randint(1, len(raw) - 1)]]
    if fam == 6:  # bit-flipped valid message
        raw = bytearray(encode(StatusRequest(f"f{i}")))
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return [bytes(raw)]
    # deeply nested / huge-count claims
    return [b"\x91" * 2000, b"\xdd\xff\xff\xff\xff"][i % 2:i % 2 + 1]


def test_10k_malformed_messages_agent_keeps_serving_memory_flat(tmp_path):
    agent = AgentProc(tmp_path).start()
    rng = random.Random(1234)
    try:
        async def main():
            me = KeyPair.generate()
            await pair(agent, me)
            ctx = zmq.asyncio.Context()
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            curve_client(s, me, agent.public_key)
            s.connect(agent.control)
            proc = psutil.Process(agent.proc.pid)

            async def blast(n: int, start: int) -> dict[str, int]:
                kinds: dict[str, int] = {}
                for i in range(start, start + n):
                    await s.send_multipart(_junk(rng, i))
                    assert await s.poll(5000), f"no reply to message {i}"
                    reply = decode(await s.recv())
                    name = reply.code if isinstance(reply, ErrorReply) else type(reply).__name__
                    kinds[name] = kinds.get(name, 0) + 1
                return kinds

            await blast(1000, 0)  # warm-up: allocator pools, caches
            rss0 = proc.memory_info().rss
            kinds = await blast(10_000, 1000)
            rss1 = proc.memory_info().rss
            await s.send(encode(StatusRequest("after")))
            after = decode(await asyncio.wait_for(s.recv(), 5))
            s.close(0)

            # The unauthenticated info port takes the same beating (2 000).
            i = ctx.socket(zmq.DEALER)
            i.linger = 0
            i.connect(f"tcp://127.0.0.1:{agent.base + 2}")
            for n in range(2000):
                await i.send_multipart(_junk(rng, n))
                assert await i.poll(5000)
                decode(await i.recv())
            await i.send(encode(InfoRequest("ok")))
            info = decode(await asyncio.wait_for(i.recv(), 5))
            i.close(0)
            ctx.term()
            return kinds, rss0, rss1, after, info

        kinds, rss0, rss1, after, info = asyncio.run(main())
        growth = rss1 - rss0
        print(f"\nfuzz replies: {kinds}; agent RSS {rss0 / 2**20:.1f} MiB -> {rss1 / 2**20:.1f} MiB "
              f"(growth {growth / 2**10:.0f} KiB over 10 000 messages)")
        assert isinstance(after, StatusReply) and isinstance(info, InfoReply)
        assert sum(kinds.values()) == 10_000
        assert kinds.get("internal", 0) == 0  # no handler bug was hit
        assert growth < 8 * 2**20
        assert agent.proc.poll() is None
    finally:
        agent.stop()
