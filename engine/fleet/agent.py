"""The agent: lends this PC to paired controllers while its owner is away.

Three sockets (ports base, base+1, base+2; docs/fleet.md):
  control  ROUTER, CURVE server, ZAP = allow-list. Status, Prepare/Chunk, Load,
           Unload, Stop. Also pushes AgentEvent to controllers it heard from.
  pairing  ROUTER, CURVE server, ZAP = any key. PairRequest only.
  info     ROUTER, plaintext. InfoRequest only: what the TXT record says.

One task per socket handles its messages in order (no two Loads race); a
housekeeping task polls the machine every POLL_S, enforces the sharing policy
(yields within 2 s when the user returns) and re-announces over mDNS when the
idle state flips or free RAM moves by more than a threshold.

Nothing a peer sends can end the agent: every message is decoded strictly,
anything wrong gets an ErrorReply, and an unexpected exception in a handler is
logged and answered with "internal". Work the agent will not take (a shard its
disk cannot hold, a worker over its policy or free RAM, a device not shared,
the owner back, the PC busy) is answered "refused" with a Refusal saying why
in fields (engine/protocol/errors.py REFUSAL_REASONS; docs/fleet.md "Refusals").
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from engine import __version__
from engine.fleet import sysinfo
from engine.fleet.agent_config import AgentConfig
from engine.fleet.discovery import INFO_OFFSET, PAIR_OFFSET
from engine.fleet.idle import default_idle_source
from engine.fleet.identity import NodeIdentity
from engine.fleet.mdns import MdnsAdvertiser, open_zeroconf
from engine.fleet.paths import ensure_private_dir
from engine.fleet.policy import GB, MachineProbe, MachineState, SharingPolicy, check_start, evaluate
from engine.transport.security import (CONTROL_DOMAIN, PAIR_DOMAIN, FleetAuthenticator, PairingBook,
                                   curve_server)
from engine.fleet.shards import NoRoom, ShardStore
from engine.fleet.workers import STOP_GRACE_S, LaunchOptions, Worker, WorkerSupervisor
from engine.protocol.codec import MAX_MESSAGE_BYTES, decode, encode
from engine.protocol.control import (AgentEvent, AgentInfo, AgentUp, ChunkReply, ChunkRequest, InfoReply,
                                     InfoRequest, LoadReply, LoadRequest, PairReply, PairRequest,
                                     PrepareReply, PrepareRequest, StatusReply, StatusRequest,
                                     StopReply, StopRequest, UnloadReply, UnloadRequest)
from engine.protocol.errors import ProtocolError
from engine.protocol.messages import ErrorReply
from engine.protocol.version import PROTOCOL_VERSION

log = logging.getLogger("flotilla.agent")
YIELD_S = 2.0  # the promise: workers gone this long after the user's return (hand-over grace included)
RAM_STEP = 256 * 1024 * 1024  # re-announce when free RAM moves by more than this
MIN_ANNOUNCE_S = 2.0  # ...but not more often than this (idle flips go out at once)
CONTROLLER_TTL_S = 3600.0  # push events to controllers heard from within this
MAX_CONTROLLERS = 64
REPLAY_WINDOW = 1024  # request ids remembered per controller key


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.demo = None
        if cfg.demo_auto_pair:  # refuses (ValueError) anything but a `flotilla demo` config dir
            from engine.fleet.demo_mode import check_demo_dir

            self.demo = check_demo_dir(cfg.config, cfg.bind)
        self.identity = NodeIdentity.load(cfg.config)
        self.keys = self.identity.keys
        self.book = PairingBook(cfg.config)
        self.store = ShardStore(cfg.data / "shards")
        self.supervisor = WorkerSupervisor(cfg.worker_command, ensure_private_dir(cfg.data / "logs"),
                                           on_exit=self._worker_exited)
        self.probe = MachineProbe(cfg.idle or default_idle_source())
        self.policy = SharingPolicy.load(cfg.config)
        self._policy_stamp = self._stamp()
        self.state: MachineState = self.probe.read()
        self.ports = (0, 0, 0)
        self.stopped = asyncio.Event()
        self.counters = collections.Counter()  # handled / errors per socket, for tests and status
        self._controllers: dict[bytes, float] = {}  # control-socket routing id -> last heard
        self._seen: dict[str, collections.deque] = {}  # controller key -> recent request ids
        self._announced: AgentInfo | None = None
        self._announced_at = 0.0
        self._tasks: list[asyncio.Task] = []
        self._advertiser: MdnsAdvertiser | None = None
        self._azc = None

    # ------------------------------------------------------------ lifecycle

    async def async_start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.auth = FleetAuthenticator(zmq.Context.shadow(self.ctx.underlying), self.book.allowed)
        self.auth.start()
        base = self.cfg.port
        self.control = self._socket(CONTROL_DOMAIN, base)
        self.pairing = self._socket(PAIR_DOMAIN, base + PAIR_OFFSET if base else 0)
        self.info = self._socket(None, base + INFO_OFFSET if base else 0)
        self.ports = tuple(int(s.last_endpoint.decode().rsplit(":", 1)[1])
                           for s in (self.control, self.pairing, self.info))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._serve(self.control, self._on_control, "control")),
                       loop.create_task(self._serve(self.pairing, self._on_pair, "pairing")),
                       loop.create_task(self._serve(self.info, self._on_info, "info"))]
        await asyncio.to_thread(sysinfo.openvino_devices)  # slow once; not on the loop
        if self.cfg.mdns:
            self._azc, addresses = open_zeroconf(self.cfg.interfaces)
            self._advertiser = MdnsAdvertiser(self._azc, addresses, self.cfg.mdns_ttl)
            log.info("announcing %s on mDNS (%s)", self.identity.node_id, ", ".join(addresses))
        await self._announce(force=True)
        self._tasks.append(loop.create_task(self._housekeeping()))
        log.info("agent %s up: control %d, pairing %d, info %d, key %s", self.identity.node_id,
                 *self.ports, self.keys.fingerprint)
        if self.cfg.announce is not None:  # the starter's word that we serve, as fields (control.AgentUp)
            up = AgentUp(self.identity.node_id, *self.ports)
            self.cfg.announce.write(up.line().encode() + b"\n")
            self.cfg.announce.flush()

    def _socket(self, domain: str | None, port: int) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.maxmsgsize = MAX_MESSAGE_BYTES + 4096  # bigger: libzmq drops the connection
        sock.sndhwm = sock.rcvhwm = 1000
        if domain is not None:
            curve_server(sock, self.keys, domain)
        sock.bind(f"tcp://{self.cfg.bind}:{port or '*'}")
        return sock

    async def async_close(self) -> None:
        await self.supervisor.stop_all()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._advertiser is not None:
            try:
                await self._advertiser.async_unregister()
            finally:
                await self._azc.async_close()
        for s in (self.control, self.pairing, self.info):
            s.close(0)
        self.auth.stop()
        self.ctx.term()
        log.info("agent stopped")

    async def async_run(self) -> None:
        await self.async_start()
        try:
            await self.stopped.wait()
        finally:
            await self.async_close()

    # ------------------------------------------------------------ serving

    async def _serve(self, sock: zmq.asyncio.Socket, handler: Callable, name: str) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            ident = frames[0].bytes
            rid = None
            try:
                if len(frames) != 2:  # a DEALER sends exactly one frame per request
                    raise ProtocolError(f"expected one message frame, got {len(frames) - 1}")
                user = frames[1].get("User-Id") if name != "info" else None
                msg = decode(frames[1].bytes)
                rid = getattr(msg, "request_id", None)
                reply = await handler(msg, user, ident)
                self.counters[f"{name}_ok"] += 1
            except ProtocolError as e:
                reply = ErrorReply.from_exception(e, rid)
                self.counters[f"{name}_refused"] += 1
            except Exception as e:  # a bug here must not take the agent down
                log.exception("%s handler failed", name)
                reply = ErrorReply.from_exception(e, rid)
                self.counters[f"{name}_internal"] += 1
            try:
                await sock.send_multipart([ident, encode(reply)])
            except zmq.ZMQError as e:  # the peer went away; ROUTER would drop it anyway
                log.debug("reply to a gone peer dropped: %s", e)

    async def _on_info(self, msg: Any, user: str | None, ident: bytes) -> Any:
        if not isinstance(msg, InfoRequest):
            raise ProtocolError("the info port answers InfoRequest only", "unknown_kind")
        return InfoReply(msg.request_id, self.announced_info())

    async def _on_pair(self, msg: Any, user: str | None, ident: bytes) -> Any:
        if not isinstance(msg, PairRequest):
            # Unpaired keys reach this socket; give them nothing else.
            raise ProtocolError("not paired: only PairRequest is accepted on the pairing port",
                                "not_paired")
        if self.demo is not None and user == self.demo.controller_key and user not in self.book.allowed:
            log.warning("demo mode: pairing %r (the demo's own controller) without a code", msg.controller_name)
            self.book.allowed.add(user, msg.controller_name)
        state, code = self.book.request(user or "", msg.controller_name, self.keys.public)
        return PairReply(msg.request_id, state, code, sysinfo.hostname())

    async def _on_control(self, msg: Any, user: str | None, ident: bytes) -> Any:
        # ZAP admitted this key at handshake; check again per message so a
        # revocation takes effect on open connections too.
        if not user or user not in self.book.allowed:
            raise ProtocolError("not paired (or pairing revoked)", "not_paired")
        seen = self._seen.setdefault(user, collections.deque(maxlen=REPLAY_WINDOW))
        rid = getattr(msg, "request_id", None)
        if rid is not None:
            if rid in seen:
                raise ProtocolError("request_id already used: replay refused")
            seen.append(rid)
        self._controllers[ident] = time.time()
        if len(self._controllers) > MAX_CONTROLLERS:
            del self._controllers[min(self._controllers, key=self._controllers.get)]
        handler = self._control_handlers().get(type(msg))
        if handler is None:
            raise ProtocolError(f"{type(msg).__name__} is not a control request", "unknown_kind")
        return await handler(msg)

    def _control_handlers(self) -> dict[type, Callable]:
        return {StatusRequest: self._status, PrepareRequest: self._prepare, ChunkRequest: self._chunk,
                LoadRequest: self._load, UnloadRequest: self._unload, StopRequest: self._stop}

    async def _status(self, msg: StatusRequest) -> StatusReply:
        decision = evaluate(self.policy, self.state)
        shards = {s.sha256: s for s in self.store.list()}
        for w in self.supervisor.workers.values():
            shards[w.sha256] = w.info()
        return StatusReply(msg.request_id, self.agent_info(), decision.share, decision.reason,
                           tuple(shards.values())[:1024])

    async def _prepare(self, msg: PrepareRequest) -> PrepareReply:
        try:
            cached, have = await self.store.prepare(msg.shard_id, msg.sha256, msg.size)
        except NoRoom as e:
            log.warning("refused shard %s (%s): %s", msg.sha256[:16], msg.shard_id, e)
            raise
        return PrepareReply(msg.request_id, msg.sha256, cached, have)

    async def _chunk(self, msg: ChunkRequest) -> ChunkReply:
        have, complete = await self.store.write_chunk(msg.sha256, msg.offset, msg.data, msg.chunk_sha256)
        if complete:
            log.info("shard %s received and verified", msg.sha256[:16])
        return ChunkReply(msg.request_id, msg.sha256, have, complete)

    async def _load(self, msg: LoadRequest) -> LoadReply:
        path = self.store.cached_path(msg.sha256)
        meta = self.store.meta(msg.sha256)
        if path is None or meta is None:
            raise ProtocolError("shard not cached here: prepare and send it first", "not_found")
        self.state = await asyncio.to_thread(self.probe.read)
        shard = await asyncio.to_thread(self._unpacked, msg.sha256)
        self._check_memory(msg, meta, shard)
        opts = LaunchOptions(msg.device, msg.data_port, self.cfg.bind, msg.exact,
                             self._curve_file(msg.sha256, msg.ring_keys), self.cfg.data / "ov-cache",
                             msg.ring_keys, msg.kv_precision)
        worker = await self.supervisor.start(str(meta.get("shard_id", msg.sha256)), msg.sha256,
                                             meta["size"], shard, msg.device, msg.data_port, opts)
        if worker.exit_code is not None or worker.proc.returncode is not None:
            raise ProtocolError(f"the shard worker exited at once (code {worker.proc.returncode}); "
                                f"see the agent's logs/worker-{msg.sha256[:12]}.log", "internal")
        return LoadReply(msg.request_id, worker.info(), worker.data_port)

    def _check_memory(self, msg: LoadRequest, meta: dict, shard: Path) -> None:
        """Refuse ("refused", with a Refusal: reason, need_bytes, limit_bytes) a worker that would not fit
        the policy's RAM cap or free RAM less the OS reserve: its shard + KV for the
        request's context x streams (LoadRequest.context_length / streams; context 0 =
        DEFAULT_CONTEXT) at its KV precision + the runtime reserve. Running workers count
        with what they were sized at."""
        import json

        from engine.fleet.policy import start_need
        from engine.models.profile import DEFAULT_CONTEXT

        try:
            manifest = json.loads((shard / "shard.json").read_text()) if shard.is_dir() else None
        except (OSError, ValueError):
            manifest = None
        context = msg.context_length or DEFAULT_CONTEXT
        streams = msg.streams
        need = start_need(meta["size"], manifest, msg.device, msg.exact, context, streams, msg.kv_precision)
        sized = self.__dict__.setdefault("_start_needs", {})  # sha256 -> bytes it was started with
        used = sum(sized.get(w.sha256, w.size) for w in self.supervisor.running() if w.sha256 != msg.sha256)
        decision = check_start(self.policy, self.state, msg.device, meta["size"], used, need)
        if not decision.share:
            raise ProtocolError(decision.message(), refusal=decision.refusal())
        sized[msg.sha256] = need.total

    def _unpacked(self, sha: str) -> Path:
        """The shard's folder (bundles arrive unpacked, shards.py); other shards
        as the file they are. Raises ProtocolError if it vanished meanwhile."""
        path = self.store.shard_path(sha)
        if path is None:
            raise ProtocolError("shard not cached here: prepare and send it first", "not_found")
        return path

    def _curve_file(self, sha: str, ring_keys: tuple[str, ...]) -> Path:
        """The worker's CURVE setup (0600): our node key, paired controllers, the ring's agents."""
        from engine.transport.curve_data import write_curve_file
        from engine.transport.security import ALLOW_FILE, SECRET_FILE

        run = ensure_private_dir(self.cfg.data / "run")
        return write_curve_file(run / f"worker-{sha[:12]}.curve.json", self.cfg.config / SECRET_FILE,
                                ring_keys, self.cfg.config / ALLOW_FILE)

    async def _unload(self, msg: UnloadRequest) -> UnloadReply:
        worker = await self.supervisor.stop(msg.sha256)
        if worker is None:
            raise ProtocolError("no worker for that shard", "not_found")
        return UnloadReply(msg.request_id, worker.info())

    async def _stop(self, msg: StopRequest) -> StopReply:
        stopped = await self.supervisor.stop_all()
        if msg.shutdown:
            # Reply first: set the event on the next loop turn, after the send.
            asyncio.get_running_loop().call_later(0.2, self.stopped.set)
        return StopReply(msg.request_id, len(stopped))

    # ------------------------------------------------------------ housekeeping

    def agent_info(self, state: MachineState | None = None) -> AgentInfo:
        s = state or self.state
        idle = s.idle_s is not None and s.idle_s >= self.policy.idle_minutes * 60
        return AgentInfo(
            node_id=self.identity.node_id, hostname=sysinfo.hostname(), os=sysinfo.os_name(),
            version=__version__, protocol=PROTOCOL_VERSION, devices=sysinfo.openvino_devices(),
            ram_total=s.ram_total, ram_available=self._shareable_ram(s), idle=idle,
            idle_since=None if s.idle_since is None else max(0.0, s.idle_since), on_ac=s.on_ac,
            control_port=self.ports[0], pair_port=self.ports[1], info_port=self.ports[2],
            public_key=self.keys.public, fingerprint=self.keys.fingerprint)

    def _shareable_ram(self, s: MachineState) -> int:
        """What new shards may use now: free RAM, at most the sharing policy's RAM cap
        less what running workers were started with (planners size plans by this)."""
        sized = self.__dict__.get("_start_needs", {})
        used = sum(sized.get(w.sha256, w.size) for w in self.supervisor.running())
        return max(0, min(s.ram_available, int(self.policy.max_ram_gb * GB) - used))

    def _stamp(self) -> float | None:
        try:
            return (self.cfg.config / "sharing_policy.json").stat().st_mtime_ns
        except FileNotFoundError:
            return None

    async def _housekeeping(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception:
                log.exception("housekeeping failed")  # try again next beat
            await asyncio.sleep(self.cfg.poll_s)

    async def _tick(self) -> None:
        if self.demo is not None:
            from engine.fleet.demo_mode import parent_alive

            if not parent_alive(self.demo):
                log.warning("demo mode: the demo process %d is gone; stopping", self.demo.parent_pid)
                self.stopped.set()
                return
        stamp = self._stamp()
        if stamp != self._policy_stamp:
            self._policy_stamp, self.policy = stamp, SharingPolicy.load(self.cfg.config)
            log.info("sharing policy reloaded: %s", self.policy)
        self.state = await asyncio.to_thread(self.probe.read)
        decision = evaluate(self.policy, self.state)
        if not decision.share and self.policy.yield_on_return and self.supervisor.running():
            await self._yield(decision.reason)
        await self._announce()

    async def _yield(self, reason: str) -> None:
        """The owner is back: hand the shards back, then stop what is left.
        With a grace (policy.yield_grace_s), controllers first get a "yielding"
        event and may migrate the shards away and Unload them; the wait ends
        early when no worker is left, and always so that the workers are gone
        within YIELD_S of the user's return (a hung one is killed)."""
        t0 = time.monotonic()
        running = self.supervisor.running()
        grace = self.policy.yield_grace_s if self._controllers else 0.0
        if grace > 0:
            returned = self.state.idle_since if self.state.idle_since is not None else time.time()
            grace = min(grace, returned + YIELD_S - STOP_GRACE_S - 0.15 - time.time())
        if grace > 0:
            await self._push(AgentEvent(self.identity.node_id, "yielding", reason,
                                        tuple(w.sha256 for w in running), time.time()))
            end = time.monotonic() + grace
            while self.supervisor.running() and time.monotonic() < end:
                await asyncio.sleep(0.02)
        handed = len(running) - len(self.supervisor.running())
        stopped = await self.supervisor.stop_all()
        log.warning("yielded to the local user (%s): %d worker(s) handed back, %d stopped, in %.2f s",
                    reason, handed, len(stopped), time.monotonic() - t0)
        if stopped:
            await self._push(AgentEvent(self.identity.node_id, "yield", reason,
                                        tuple(w.sha256 for w in stopped), time.time()))

    async def _announce(self, force: bool = False) -> None:
        """Refresh the announced AgentInfo (mDNS TXT and the info port) when
        something people act on moved: idle state or power at once, free RAM
        by more than RAM_STEP at most every MIN_ANNOUNCE_S. Small RAM jitter
        would otherwise flood the LAN and every controller's peer list."""
        info, old = self.agent_info(), self._announced
        now = time.monotonic()
        flipped = old is None or info.idle != old.idle or info.on_ac != old.on_ac
        moved = old is not None and abs(info.ram_available - old.ram_available) > RAM_STEP \
            and now - self._announced_at >= MIN_ANNOUNCE_S
        if not (force or flipped or moved):
            return
        self._announced, self._announced_at = info, now
        if self._advertiser is not None:
            await self._advertiser.async_update(info)

    def announced_info(self) -> AgentInfo:
        return self._announced or self.agent_info()

    async def _push(self, event: AgentEvent) -> None:
        horizon = time.time() - CONTROLLER_TTL_S
        data = encode(event)
        for ident, seen in list(self._controllers.items()):
            if seen < horizon:
                del self._controllers[ident]
                continue
            try:
                await self.control.send_multipart([ident, data], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _worker_exited(self, worker: Worker) -> None:
        event = AgentEvent(self.identity.node_id, "worker_exit", f"exit code {worker.exit_code}",
                           (worker.sha256,), time.time())
        asyncio.get_running_loop().create_task(self._push(event))
