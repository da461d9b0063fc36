"""The controller's side of the control plane: pair with an agent, then drive it.

    client = AgentClient(my_keys, peer.endpoint(), peer.info.public_key)
    await client.async_connect()          # NotPaired if the agent refuses our key
    status = await client.status()
    await client.send_shard(path, "llama/L0-16")   # resumes where the agent stopped
    await client.load(sha, "GPU.0", data_port=0)

Connecting waits for the CURVE handshake and reads its outcome from a socket
monitor, so "not paired" (the agent's ZAP said no) and "wrong agent key" (the
handshake could not even be decrypted) are clear errors instead of a request
that never gets an answer.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engine.fleet.bundle_view import BundleView
from engine.transport.security import KeyPair, curve_client, pairing_code
from engine.protocol.codec import decode, encode
from engine.protocol.control import (AgentEvent, ChunkReply, ChunkRequest, LoadReply, LoadRequest,
                                     PairReply, PairRequest, PrepareReply, PrepareRequest,
                                     StatusReply, StatusRequest, StopReply, StopRequest, UnloadReply,
                                     UnloadRequest)
from engine.protocol.errors import Refusal
from engine.protocol.messages import ErrorReply

DEFAULT_CHUNK = 1024 * 1024


class FleetError(Exception):
    """A control-plane failure, with a one-line reason for people."""


class NotPaired(FleetError):
    pass


class AgentRefused(FleetError):
    """The agent answered with an ErrorReply: branch on .code and .refusal, show str(e)."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(f"{reply.code}: {reply.message}")
        self.reply = reply

    @property
    def code(self) -> str:
        """One of engine.protocol.errors.ERROR_CODES."""
        return self.reply.code

    @property
    def refusal(self) -> Refusal | None:
        """Why the agent will not take the work (code "refused"): reason, need_bytes, limit_bytes."""
        return self.reply.refusal


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 * 1024 * 1024), b""):
            h.update(block)
    return h.hexdigest()


async def _handshake(sock: zmq.asyncio.Socket, endpoint: str, timeout: float) -> None:
    """Connect and wait for the CURVE handshake's verdict."""
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    try:
        sock.connect(endpoint)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            if left <= 0 or not await mon.poll(int(left * 1000)):
                raise FleetError(f"no answer from {endpoint} within {timeout:g} s")
            event = parse_monitor_message(await mon.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise NotPaired(f"not paired: the agent at {endpoint} does not know this "
                                "controller's key (pair first, or the pairing was revoked)")
            raise FleetError(f"secure handshake with {endpoint} failed: wrong agent key?")
    finally:
        sock.disable_monitor()
        mon.close(0)


class _Channel:
    """One DEALER to one agent socket; request/response by request_id."""

    def __init__(self, ctx: zmq.asyncio.Context, keys: KeyPair, endpoint: str, server_key: str,
                 timeout: float) -> None:
        self.endpoint, self.timeout = endpoint, timeout
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        curve_client(self.sock, keys, server_key)
        self.events: collections.deque[AgentEvent] = collections.deque(maxlen=256)
        self._lock = asyncio.Lock()

    async def connect(self) -> None:
        try:
            await _handshake(self.sock, self.endpoint, self.timeout)
        except BaseException:
            self.sock.close(0)
            raise

    async def request(self, msg: Any, want: type, timeout: float | None = None) -> Any:
        async with self._lock:  # one in flight keeps replies in order and simple
            await self.sock.send(encode(msg))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + (timeout or self.timeout)
            while True:
                left = deadline - loop.time()
                if left <= 0 or not await self.sock.poll(int(left * 1000)):
                    raise FleetError(f"{type(msg).__name__}: no reply from {self.endpoint}")
                reply = decode(await self.sock.recv())
                if isinstance(reply, AgentEvent):
                    self.events.append(reply)
                    continue
                if getattr(reply, "request_id", None) not in (msg.request_id, None):
                    continue  # a late reply to a request that timed out
                if isinstance(reply, ErrorReply):
                    if reply.code == "not_paired":
                        raise NotPaired(reply.message)
                    raise AgentRefused(reply)
                if not isinstance(reply, want):
                    raise FleetError(f"expected {want.__name__}, got {type(reply).__name__}")
                return reply

    async def next_event(self, timeout: float) -> AgentEvent | None:
        """The next pushed AgentEvent (already queued or arriving within timeout)."""
        if self.events:
            return self.events.popleft()
        async with self._lock:
            if await self.sock.poll(int(timeout * 1000)):
                msg = decode(await self.sock.recv())
                if isinstance(msg, AgentEvent):
                    return msg
        return self.events.popleft() if self.events else None

    def close(self) -> None:
        self.sock.close(0)


def _rid() -> str:
    return uuid.uuid4().hex


async def async_pair(keys: KeyPair, pair_endpoint: str, agent_key: str, name: str, *,
                     wait: float = 0.0, poll: float = 0.5,
                     ctx: zmq.asyncio.Context | None = None) -> PairReply:
    """Ask an agent to pair. Show pairing_code(agent_key, keys.public) to the
    user (this side's own computation, never the agent's word). With wait > 0,
    keep asking until the owner accepts or wait seconds pass."""
    own_ctx = ctx is None
    ctx = ctx or zmq.asyncio.Context()
    chan = _Channel(ctx, keys, pair_endpoint, agent_key, 5.0)
    try:
        await chan.connect()
        loop = asyncio.get_running_loop()
        end = loop.time() + wait
        while True:
            reply = await chan.request(PairRequest(_rid(), name[:255] or "controller"), PairReply)
            if reply.code != pairing_code(agent_key, keys.public):
                raise FleetError("pairing codes differ: someone may be in the middle; do not accept")
            if reply.state != "pending" or loop.time() >= end:
                return reply
            await asyncio.sleep(poll)
    finally:
        chan.close()
        if own_ctx:
            ctx.term()


class AgentClient:
    def __init__(self, keys: KeyPair, endpoint: str, agent_key: str, *, timeout: float = 10.0,
                 ctx: zmq.asyncio.Context | None = None) -> None:
        self.ctx = ctx or zmq.asyncio.Context()
        self.chan = _Channel(self.ctx, keys, endpoint, agent_key, timeout)
        # A client dropped without close() (an exception between connect and close) must
        # still release its socket: a context collected with a socket open blocks in
        # term() for ever, freezing whichever thread runs the garbage collector.
        self._release = weakref.finalize(self, _release, self.chan.sock, self.ctx if ctx is None else None)

    async def async_connect(self) -> AgentClient:
        await self.chan.connect()
        return self

    async def __aenter__(self) -> AgentClient:
        try:
            return await self.async_connect()
        except BaseException:
            self.close()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def status(self) -> StatusReply:
        return await self.chan.request(StatusRequest(_rid()), StatusReply)

    async def prepare(self, shard_id: str, sha: str, size: int) -> PrepareReply:
        return await self.chan.request(PrepareRequest(_rid(), shard_id, sha, size), PrepareReply)

    async def send_shard(self, source: Path | BundleView, shard_id: str, *, sha: str | None = None,
                         chunk: int = DEFAULT_CHUNK, progress: Callable[[int, int], None] | None = None,
                         max_chunks: int | None = None) -> ChunkReply | PrepareReply:
        """Send a shard unless the agent has it; resumes a partial one. source: a file, or
        a BundleView (a shard folder's bundle made on the fly, never written to disk).
        max_chunks stops early (tests of interrupted transfers)."""
        if isinstance(source, BundleView):
            sha = sha or await asyncio.to_thread(source.sha256)
            size, opener = source.size, source.open
        else:
            sha = sha or await asyncio.to_thread(sha256_file, source)
            size, opener = source.stat().st_size, lambda: open(source, "rb")
        prep = await self.prepare(shard_id, sha, size)
        if prep.cached:
            return prep
        offset, sent, last = prep.have_bytes, 0, prep
        with opener() as f:
            f.seek(offset)
            while offset < size:
                if max_chunks is not None and sent >= max_chunks:
                    break
                data = f.read(chunk)
                last = await self.chan.request(
                    ChunkRequest(_rid(), sha, offset, data, hashlib.sha256(data).hexdigest()), ChunkReply)
                offset, sent = last.have_bytes, sent + 1
                if progress:
                    progress(offset, size)
        return last

    async def load(self, sha: str, device: str = "CPU", data_port: int = 0, *, exact: bool = False,
                   ring_keys: tuple[str, ...] = (), timeout: float | None = None,
                   context_length: int = 0, streams: int = 1, kv_precision: str = "") -> LoadReply:
        """Start a worker on a cached shard; the reply's data_port is where it listens.
        ring_keys: the other agents of the ring, which may send to it; context_length x
        streams: the KV the plan reserved (the agent checks it fits before starting);
        kv_precision: the worker's KV cache precision ("" = the device's default)."""
        return await self.chan.request(LoadRequest(_rid(), sha, device, data_port, exact, tuple(ring_keys),
                                                   context_length, streams, kv_precision), LoadReply, timeout)

    async def unload(self, sha: str) -> UnloadReply:
        return await self.chan.request(UnloadRequest(_rid(), sha), UnloadReply)

    async def stop(self, shutdown: bool = False) -> StopReply:
        return await self.chan.request(StopRequest(_rid(), shutdown), StopReply)

    async def next_event(self, timeout: float = 5.0) -> AgentEvent | None:
        return await self.chan.next_event(timeout)

    def close(self) -> None:
        self._release()


def _release(sock: zmq.Socket, own_ctx: zmq.Context | None) -> None:
    sock.close(0)
    if own_ctx is not None:
        own_ctx.term()
