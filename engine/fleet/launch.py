"""The fleet launcher: paired agents -> a plan -> shards on them -> one PipelineEngine.

    keys = controller_keys()                       # this PC's CurveZMQ identity
    peers = discover(["127.0.0.1"], want=2)        # or Peer objects of manual peers
    engine = launch_fleet(keys, peers, LaunchConfig(model="demo"), progress,
                          on_event=lambda ev: print(ev.message))
    # or launch_fleet(keys, peers, cfg, plan=plan): the user's Plan, launched as is
    ...                                            # any Engine use: submit / stream / cancel
    engine.close()                                 # also unloads every worker

Steps, each failing with a clear message before the next starts:
1. connect to every peer's control port (CURVE; NotPaired when it does not
   know our key) and ask its Status: the sharing decision, RAM, devices;
   peers that do not share right now are left out (and said why).
2. plan: the user's Plan when one is given (the plan editor's): validated
   against the agents' fresh figures (engine.pipeline.plan_validate) and
   launched as is -- boundaries, per-stage peer and device, weight precision,
   context, streams -- never re-planned; a stage that no longer fits (a peer
   left or stopped sharing, its memory shrank) is refused by name. Without
   one the launcher plans by itself: `auto_plan` over those peers' profiles
   (or an even split over the `stages` best peers), weights "auto" resolved
   by the planner to the most precise that fits, and the
   plan is reported (progress lines "plan: ...") before anything is exported.
   Peers announcing the same address talk over loopback in the cost model. A
   plan that does not fit raises PlanError here: nothing was sent or started.
3. shards: each stage's range is exported (cache) at the plan's precision and sent to its agent
   as one bundle made on the fly from the shard folder (engine/fleet/bundle_view.py: no archive
   is written), resumable and hashed
   (skipped when the agent has it), all agents in parallel.
4. load: each agent starts a real shard worker (engine/pipeline/worker.py)
   with CURVE on its data socket, admitting this controller and the other
   agents of the ring; it reports the port it bound.
   An agent that refuses a stage at 3 (its disk) or 4 (its policy's RAM cap,
   free RAM, device, owner back, CPU busy) answers "refused" with a Refusal
   (reason, need_bytes, limit_bytes); every refusing stage is reported as one
   StageRefused (engine/fleet/refusal.py: a PlanError and a FleetError) built
   from those fields: one line per stage naming it, the peer and the numbers.
5. wire: a PipelineEngine with CURVE on every data socket: each stage's
   server key is its agent's public key, and the coordinator's return socket
   admits the ring's agent keys only.

While it runs, the agents' pushed AgentEvents (yielding: the owner came back
and the agent grants a short hand-over grace; yield: it stopped our workers;
worker_exit) are watched. An event about one of our shards becomes a
FleetEvent: logged and handed to every listener (add_listener). Then, with
recovery on (LaunchConfig.recover, the default; engine/pipeline/recovery.py):
- "yielding": engine.migrate_stage(i): a replacement is started while the
  stage still serves, the ring is re-wired onto it, every stream replayed;
  the old worker is unloaded on its agent as soon as it left the ring (the
  agent stops it itself when its grace ends first; the coordinator then
  simply pauses until the replacement is up: no token lost or repeated);
- "yield" / "worker_exit": the stage's link is marked exited, so the
  coordinator starts a recovery at its next liveness tick (< 0.2 s).
The re-plan provider (FleetRingProvider) puts a lost stage's layers on a
spare paired agent that shares its PC now and has room (the shard is sent
and loaded as at launch), else on this PC (a local shard worker, as the
local runner starts them, under this controller's key) when
LaunchConfig.local_fallback allows; else RecoveryImpossible names why, every
stream ends with an error event saying so, and the conversations are kept.
CURVE: every worker admits every agent of the session (not only its ring
neighbours at launch), so a replacement may sit anywhere in the ring.
Without recovery the engine is stopped with a clear reason ("stage 1 on
laptop-2 yielded: user returned"), so requests end at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.aio import LoopThread
from engine.platform import process
from engine.fleet.bundle_view import BundleView
from engine.fleet.client import AgentClient, AgentRefused, FleetError, NotPaired, async_pair
from engine.transport.curve_data import CurveEnd
from engine.fleet.discovery import Combined, Discovery, ManualPeers, Peer
from engine.fleet.refusal import StageRefusal, StageRefused
from engine.transport.security import KeyPair
from engine.pipeline import plan_weights
from engine.pipeline.plan import (DEFAULT_PREFERENCE, DEVICE_KINDS, LOOPBACK_LINK, DeviceProfile, PeerProfile,
                                  Plan, PlanError, PlanModel, PlanRequest, auto_plan)
from engine.protocol.control import AgentEvent, StatusReply

log = logging.getLogger(__name__)
Progress = Callable[[str, float], None]
STAGE_PHASES = ("export", "pack", "send", "have", "start")  # StageProgress.phase, in launch order


@dataclass(frozen=True)
class StageProgress:
    """One stage's launch step, for programs (the app's per-stage bars): what the progress
    line says in words, said as fields, so no caller parses the words."""

    stage: int  # ring position
    phase: str  # one of STAGE_PHASES: export (or pack a cached export), send, have (the peer has it), start
    fraction: float  # of this phase, 0..1
    message: str  # the same one line the Progress callback got
LOCAL_STOP_GRACE_S = 2.0  # a local worker's graceful stop -> kill


@dataclass(frozen=True)
class LaunchConfig:
    model: str = "demo"  # model spec: demo id, HF folder or hub id
    stages: int | None = None  # None = auto_plan chooses; k = even split over the k roomiest peers
    exact: bool = False  # f32 inference + KV cache on every stage (matches transformers)
    # Shard weight precision when the launcher plans: "auto" = the most precise at which the plan fits
    # (from the checkpoint's own dtype down), or "f32" | "bf16" | "fp16" | "int8" | "int4". With a user
    # plan it must be "auto" or that plan's own precision (the plan decides).
    weights: str = "auto"
    context_length: int | None = None  # tokens per stream (KV sizing); None = the model's own; a user plan's wins
    max_concurrent: int = 4  # streams in the ring at once (KV reserved for each on every stage); a user plan's wins
    prefill_chunk: int = 512  # prompt tokens per step
    device_preference: tuple[str, ...] = DEFAULT_PREFERENCE  # device kinds, best first
    controller_host: str | None = None  # address stages dial back; None = ours toward the first peer
    ready_timeout_s: float = 180.0  # every stage loaded and wired within this
    load_timeout_s: float = 90.0  # one agent's Load (its worker's start) within this
    chunk_bytes: int = 1024 * 1024  # shard transfer chunk
    recover: bool = True  # a lost or yielding stage is re-planned onto another agent (or this PC)
    local_fallback: bool = True  # recovery may run a lost stage on this PC when no agent can


@dataclass(frozen=True)
class FleetEvent:
    """An agent event about a stage of this pipeline."""

    stage: int  # ring index of the stage concerned
    peer_name: str  # the agent's host name (for people)
    node_id: str  # the agent
    event: AgentEvent  # what the agent pushed
    message: str  # one line for people


@dataclass
class _Stage:
    index: int
    peer: Peer | None  # None = a local worker on this PC (a recovery's last resort)
    device: str
    start: int
    end: int
    bundle: BundleView | None = None  # the shard folder's bundle, read on the fly
    sha256: str = ""
    data_port: int = 0
    pid: int | None = None
    sent_bytes: int = 0  # bytes transferred (0 = the agent had it)
    shard_path: Path | None = None  # the exported shard folder on this PC
    link: Any = None  # its StageLink once wired
    proc: Any = None  # RemoteWorker (on an agent) or Popen (local)
    endpoint: str = ""  # local workers: the address they bound

    @property
    def host(self) -> str:
        return self.peer.info.hostname if self.peer is not None else "this PC"


class RemoteWorker:
    """A worker on an agent as StageLink.proc sees it: poll() is None until the
    agent reports that it stopped (yield, exit), so the coordinator notices at
    its next liveness check instead of after the ping timeout."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


def controller_keys(config: Path | None = None) -> KeyPair:
    """This PC's CurveZMQ key pair (the same node key its agent uses)."""
    from engine.fleet.paths import config_dir, ensure_private_dir

    return KeyPair.load_or_create(ensure_private_dir(config) if config else config_dir())


def peer_profile(peer: Peer, status: StatusReply | None = None) -> PeerProfile:
    """What the planner needs from an agent's announcement (or fresher Status)."""
    info = status.info if status is not None else peer.info
    devices = tuple(DeviceProfile(d.name.split(".")[0].upper(), d.name) for d in info.devices
                    if d.name.split(".")[0].upper() in DEVICE_KINDS)
    # ram_available: what the agent shares now (min of free RAM and its policy cap); RAM total sizes the OS reserve.
    return PeerProfile(info.node_id, f"{info.hostname}-{info.node_id[:6]}", devices, info.ram_available,
                       info.ram_total)


def peer_links(peers: Sequence[Peer]) -> dict[tuple[str, str], Any]:
    """Peers answering on the same address are one host: loopback between them."""
    out = {}
    for a in peers:
        for b in peers:
            if a.node_id < b.node_id and a.same_host(b):
                out[(a.node_id, b.node_id)] = LOOPBACK_LINK
    return out


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


# ---------------------------------------------------------------- the session


class FleetSession:
    """One pipeline's agents: control clients, shards, workers and their events."""

    def __init__(self, keys: KeyPair, peers: Sequence[Peer], cfg: LaunchConfig = LaunchConfig(),
                 progress: Progress | None = None, plan: Plan | None = None,
                 on_stage: Callable[[StageProgress], None] | None = None) -> None:
        if not peers:
            raise FleetError("no agents to launch on: start `flotilla agent` on the PCs (and pair them)")
        self.keys, self.cfg = keys, cfg
        self.peers = {p.node_id: p for p in peers}
        self.progress = progress or (lambda _m, _f: None)
        self.on_stage = on_stage or (lambda _p: None)
        self.user_plan = plan  # the user's plan: launched as is (checked, never re-planned); None = we plan
        self.plan: Plan | None = None  # the plan being launched (the user's very object when given)
        self.plan_lines: list[str] = []  # the plan as reported before export (when the launcher planned)
        self.stages: list[_Stage] = []
        self.statuses: dict[str, StatusReply] = {}
        self.left_out: dict[str, str] = {}  # node_id -> why it was not used
        self.events: list[FleetEvent] = []  # every event about our stages, in order
        self.engine: Any = None
        self.break_on_event = not cfg.recover  # stop the engine when a stage's agent yields or its worker dies
        self.provider: FleetRingProvider | None = None  # recovery (cfg.recover)
        self._all: list[_Stage] = []  # every stage ever started (unloaded at stop)
        self._host = "127.0.0.1"  # the address stages dial back (and local workers bind)
        self._local_dir: Path | None = None  # this PC's key file for local workers
        self._listeners: list[Callable[[FleetEvent], None]] = []
        self._clients: dict[str, AgentClient] = {}
        self._loop = LoopThread("flotilla-fleet")
        self._watch: asyncio.Future | None = None
        self._stopped = False
        self.timings: dict[str, float] = {}

    def add_listener(self, listener: Callable[[FleetEvent], None]) -> None:
        """Called (on the session's thread) for every FleetEvent. With recovery
        on (cfg.recover) the session migrates / recovers the stage itself after
        the listeners ran; with it off the engine stops unless break_on_event
        is set False (then the listener handles the event)."""
        self._listeners.append(listener)

    # -- steps -------------------------------------------------------------------
    def launch(self) -> Any:
        """Plan, send, load and wire; returns the PipelineEngine (engine.fleet = self)."""
        from engine.models import profile_model, resolve_model
        from engine.models.profile import engine_context, trained_context

        t0 = time.monotonic()
        resolved = resolve_model(self.cfg.model, self.progress)
        model_path = Path(resolved.path)
        self.model_id = resolved.model_id
        plan_weights.refuse_unsupported(model_path)  # before any plan or export
        self._trained = trained_context(model_path)
        if self.user_plan is not None:  # the plan's context and streams, as the user saw them
            self.context_length, self.streams = self.user_plan.context_length, self.user_plan.streams
        else:  # None: what a chat user picks (DEFAULT_CONTEXT, at most the model's), not its maximum
            self.context_length = engine_context(model_path, self.cfg.context_length)
            self.streams = self.cfg.max_concurrent
        model = PlanModel.from_profile(profile_model(resolved))
        # The tokenizer (and transformers' import, seconds) loads while shards travel.
        tok: list[Any] = []
        loader = threading.Thread(target=lambda: tok.append(_load_tokenizer(model_path)), daemon=True)
        loader.start()
        try:
            self._loop.call(self._connect_all(), 60)
            self.plan = self._make_plan(model)
            self.timings["plan_s"] = time.monotonic() - t0
            self._export(model_path, model.num_layers)
            t = time.monotonic()
            self._loop.call(self._send_all(), None)
            self.timings["transfer_s"] = time.monotonic() - t
            t = time.monotonic()
            self._loop.call(self._load_all(), None)
            loader.join()
            self.engine = self._wire(model_path, tok[0] if tok else None)
            if self.cfg.recover:
                self.provider = FleetRingProvider(self)
                self.engine.enable_recovery(self.provider)
            self.timings["load_s"] = time.monotonic() - t
        except BaseException:
            self.stop()
            raise
        self._watch = self._loop.submit(self._watch_events())
        self.engine.fleet = self
        self.timings["launch_s"] = time.monotonic() - t0
        return self.engine

    async def _connect_all(self) -> None:
        async def one(peer: Peer) -> None:
            client = AgentClient(self.keys, peer.endpoint(), peer.info.public_key, timeout=15.0)
            try:
                await client.async_connect()
            except NotPaired:
                client.close()
                raise NotPaired(f"{peer.info.hostname} ({peer.info.fingerprint}) has not paired with this "
                                "controller: pair first (`flotilla agent pair --accept CODE` on it)") from None
            except BaseException:
                client.close()
                raise
            self._clients[peer.node_id] = client
            self.statuses[peer.node_id] = await client.status()

        results = await asyncio.gather(*(one(p) for p in self.peers.values()), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    def _make_plan(self, model: PlanModel) -> Plan:
        """The plan to launch: the user's (checked) or our own (reported); PlanError before anything is sent."""
        from engine.pipeline.plan_validate import evaluate_plan
        from engine.pipeline.runner import even_split

        if self.user_plan is not None:
            return self._check_user_plan(model)
        plan_weights.check_choice(self.cfg.weights)
        usable = []
        for nid, st in self.statuses.items():
            if not st.sharing:
                self.left_out[nid] = f"not sharing now: {st.reason}"
            else:
                usable.append(self.peers[nid])
        if not usable:
            why = "; ".join(f"{self.peers[n].info.hostname}: {r}" for n, r in self.left_out.items())
            raise PlanError(f"no agent shares its PC right now ({why})")
        profiles = [peer_profile(p, self.statuses[p.node_id]) for p in usable]
        # "auto" weights: the planner picks the most precise at which its plan fits.
        request = PlanRequest(context_length=self.context_length, streams=self.streams, exact=self.cfg.exact,
                              weight_precision=self.cfg.weights)
        links = peer_links(usable)
        if self.cfg.stages is None:
            plan = auto_plan(model, profiles, request, links, self.cfg.device_preference)
        else:
            k = self.cfg.stages
            if k > len(profiles):
                raise PlanError(f"{k} stages need {k} sharing agents; {len(profiles)} found")
            chosen = sorted(profiles, key=lambda p: (-p.ram_free_bytes, p.peer_id))[:k]
            specs = []
            for prof, (s, e) in zip(chosen, even_split(model.num_layers, k)):
                kinds = [d for kind in self.cfg.device_preference for d in prof.devices if d.kind == kind]
                if not kinds:
                    raise PlanError(f"{prof.name} offers no device of kinds {', '.join(self.cfg.device_preference)}")
                specs.append((prof.peer_id, kinds[0].name, s, e))
            plan = evaluate_plan(specs, model, profiles, request, links)
            plan_weights.check_plan(plan, model, profiles, plan_weights.request_of(plan),
                                    "the plan does not fit the fleet", asked=self.cfg.weights)
        # We planned: show the plan we will use before anything is exported.
        names = {p.node_id: p.info.hostname for p in usable}
        self.plan_lines = plan_weights.describe_plan(plan, names, chosen=self.cfg.weights)
        for line in self.plan_lines:
            log.info("fleet: %s", line.strip())
            self.progress(line, 0.0)
        self._adopt(plan, model, plan_weights.request_of(plan))
        return plan

    def _check_user_plan(self, model: PlanModel) -> Plan:
        """The user's plan, unchanged, once it still fits the agents as they are now."""
        plan = self.user_plan
        precision = plan_weights.plan_precision(plan)
        if self.cfg.weights not in ("auto", precision):
            raise plan_weights.refuse(None, "weights_conflict",
                                      f"the plan's weights are {precision} but {self.cfg.weights} was asked: "
                                      "change the precision in the plan")
        if plan.model_id and model.model_id and plan.model_id != model.model_id:
            raise plan_weights.refuse(None, "model_mismatch",
                                      f"the plan is for {plan.model_id}, not {model.model_id}: plan again")
        if plan.context_length > self._trained:
            raise plan_weights.refuse(None, "context_too_long",
                                      f"the plan reserves {plan.context_length} tokens of context but "
                                      f"{self.model_id} was trained for {self._trained}")
        for i, st in enumerate(plan.stages):
            peer = self.peers.get(st.peer_id)
            if peer is None:
                raise plan_weights.refuse(i, "peer_gone", f"stage {i} (layers {st.start}–{st.end}): its peer "
                                                          f"{st.peer_id[:8]} is not among the agents any more")
            status = self.statuses.get(st.peer_id)
            if status is not None and not status.sharing:
                raise plan_weights.refuse(i, "not_sharing",
                                          f"stage {i} (layers {st.start}–{st.end}): {peer.info.hostname} does "
                                          f"not share its PC right now: {status.reason or 'policy'}")
        for nid in self.peers:
            if nid not in plan.peer_ids:
                self.left_out[nid] = "not in the plan"
        used = [self.peers[pid] for pid in dict.fromkeys(plan.peer_ids)]
        profiles = [peer_profile(p, self.statuses.get(p.node_id)) for p in used]
        # Checked as it will run: exact mode (f32 KV) if this launch asks for it.
        request = plan_weights.request_of(plan, exact=plan.exact or self.cfg.exact)
        plan_weights.check_plan(plan, model, profiles, request, "the plan no longer fits the fleet")
        self._adopt(plan, model, request)
        return plan

    def _adopt(self, plan: Plan, model: PlanModel, request: PlanRequest) -> None:
        """Stages from the plan, exactly: peer, device and layer range of each."""
        self.stages = [_Stage(i, self.peers[s.peer_id], s.device, s.start, s.end) for i, s in enumerate(plan.stages)]
        self.precision = plan_weights.plan_precision(plan)  # what every shard is exported at
        self._plan_model, self._plan_request = model, request

    def _export(self, model_path: Path, total: int) -> None:
        import openvino as ov

        from engine.fleet.bundle import cached_bundle
        from engine.models.demo import cache_root
        from engine.pipeline.export import MANIFEST, ensure_shard, model_fingerprint, shard_cache_key, shard_cache_root

        fp = model_fingerprint(model_path)
        for st in self.stages:  # ranges and precision from the plan, one range at a time
            key = shard_cache_key(fp, st.start, st.end, self.precision, ov.get_version())
            cached = (shard_cache_root() / key / MANIFEST).exists()
            self._stage_step(st, "pack" if cached else "export", 0.0,
                             f"{'packing' if cached else 'exporting'} shard {st.index} (layers {st.start}–{st.end}, "
                             f"{self.precision})", st.index / len(self.stages))
            info = ensure_shard(model_path, st.start, st.end, num_layers_total=total, precision=self.precision)
            st.bundle, st.sha256 = cached_bundle(Path(info.path), cache_root() / "bundles")
            st.shard_path = Path(info.path)

    def _stage_step(self, st: _Stage, phase: str, fraction: float, message: str,
                    overall: float | None = None) -> None:
        """Report one stage's step: the line to the Progress callback (with `overall`, or the
        phase's fraction), its fields to on_stage."""
        self.progress(message, fraction if overall is None else overall)
        self.on_stage(StageProgress(st.index, phase, fraction, message))

    async def _send_all(self) -> None:
        # Each agent first says whether its disk can take its shard (PrepareRequest),
        # so a full disk is one line naming the peer before any chunk travels anywhere.
        _raise_refusals(await asyncio.gather(*(self._room_for(st) for st in self.stages), return_exceptions=True))
        await asyncio.gather(*(self._send_one(st) for st in self.stages))

    def _shard_id(self, st: _Stage) -> str:
        return f"{self.model_id[:80]}/L{st.start}-{st.end}"

    async def _room_for(self, st: _Stage) -> None:
        """Returns when st's agent has its shard or room for it; raises _refused(st, e) when not."""
        try:
            await self._clients[st.peer.node_id].prepare(self._shard_id(st), st.sha256, st.bundle.size)
        except AgentRefused as e:
            raise _refused(st, e, "prepare") from None

    async def _send_one(self, st: _Stage) -> None:
        client = self._clients[st.peer.node_id]
        size = st.bundle.size
        name = st.peer.info.hostname

        def shown(have: int, total: int) -> None:
            self._stage_step(st, "send", have / max(1, total),
                             f"sending shard {st.index} to {name}: {have / 1e6:.1f}/{total / 1e6:.1f} MB")

        try:
            last = await client.send_shard(st.bundle, self._shard_id(st), sha=st.sha256,
                                           chunk=self.cfg.chunk_bytes, progress=shown)
        except AgentRefused as e:  # the disk filled meanwhile (or a bad bundle): name the peer
            raise _refused(st, e, "prepare") from None
        if getattr(last, "cached", False):
            self._stage_step(st, "have", 1.0, f"shard {st.index}: {name} already has it")
        else:
            st.sent_bytes = size
            if not getattr(last, "complete", False):
                raise FleetError(f"sending shard {st.index} to {name} stopped at {last.have_bytes} bytes")

    async def _load_all(self) -> None:
        # Every agent answers (started or refused) before we report, so every refusing stage is named.
        _raise_refusals(await asyncio.gather(*(self._load_one(st) for st in self.stages), return_exceptions=True))

    async def _load_one(self, st: _Stage) -> None:
        # Every agent of the session may feed this worker (a recovery can put any of them next to it).
        ring = sorted({p.info.public_key for p in self.peers.values()})
        self._stage_step(st, "start", 0.0, f"starting stage {st.index} on {st.peer.info.hostname} ({st.device})")
        others = tuple(k for k in ring if k != st.peer.info.public_key)
        self._all.append(st)  # unloaded at stop, even when the load fails half-way
        try:
            reply = await self._clients[st.peer.node_id].load(
                st.sha256, st.device, 0, exact=self.cfg.exact, ring_keys=others, timeout=self.cfg.load_timeout_s,
                context_length=self.context_length or 0, streams=self.streams or 1)
        except AgentRefused as e:  # the worker would not fit, the owner is back...: name stage and peer
            raise _refused(st, e, "load") from None
        if not reply.data_port:
            raise FleetError(f"the worker on {st.peer.info.hostname} did not say which port it bound")
        st.data_port, st.pid = reply.data_port, reply.shard.pid
        st.proc = RemoteWorker(st.pid)

    def _wire(self, model_path: Path, tokenizer: Any = None) -> Any:
        from engine.pipeline.coordinator import PipelineConfig, PipelineEngine, StageLink

        for st in self.stages:
            st.link = StageLink(st.index, st.start, st.end, st.peer.endpoint(st.data_port), proc=st.proc,
                                pid=st.pid, server_key=st.peer.info.public_key)
        links = [st.link for st in self.stages]
        host = self.cfg.controller_host or local_address_toward(self.stages[0].peer.host)
        self._host = host
        pcfg = PipelineConfig(max_concurrent=self.streams, prefill_chunk=self.cfg.prefill_chunk,
                              context_length=self.context_length, return_bind=f"tcp://{host}:*",
                              ready_timeout_s=self.cfg.ready_timeout_s, device=self.stages[0].device,
                              curve=CurveEnd(self.keys))
        self.progress(f"wiring {len(links)} stages (shards compile on first use)", 0.0)
        return PipelineEngine(links, model_path, self.model_id, pcfg, on_close=self.stop, tokenizer=tokenizer)

    # -- events ------------------------------------------------------------------
    async def _watch_events(self) -> None:
        while not self._stopped:
            for nid, client in list(self._clients.items()):
                try:
                    ev = await client.next_event(0.05)
                except Exception:  # the channel is closing
                    ev = None
                if ev is not None:
                    self._on_agent_event(nid, ev)
            await asyncio.sleep(0.1)

    def _on_agent_event(self, node_id: str, ev: AgentEvent) -> None:
        ours = [st for st in self.stages if st.peer is not None and st.peer.node_id == node_id
                and (not ev.shards or st.sha256 in ev.shards)]
        if not ours:
            return  # not about our ring (e.g. a stage that was already replaced)
        for st in ours:
            what = {"yielding": "is yielding to its user", "yield": "yielded to its user"}.get(
                ev.event, "lost its shard worker")
            msg = (f"stage {st.index} (layers {st.start}–{st.end}) on {st.peer.info.hostname} {what}: "
                   f"{ev.detail or ev.event}")
            fe = FleetEvent(st.index, st.peer.info.hostname, node_id, ev, msg)
            self.events.append(fe)
            log.warning("fleet: %s", msg)
            for listener in list(self._listeners):
                try:
                    listener(fe)
                except Exception:
                    log.exception("fleet event listener failed")
            recovery = getattr(self.engine, "recovery", None)
            if recovery is not None and recovery.enabled:
                if ev.event == "yielding":  # hand over while it still serves
                    fut = self.engine.migrate_stage(st.index, f"{st.host} is needed by its user ({ev.detail})")
                    fut.add_done_callback(lambda f, m=msg: _log_migration(f, m))
                elif isinstance(st.proc, RemoteWorker) and st.proc.returncode is None:
                    st.proc.returncode = _exit_code(ev)  # the coordinator recovers at its next tick
            elif self.break_on_event and self.engine is not None:
                _break_engine(self.engine, f"{msg}; the pipeline stopped (recovery is off)")

    # -- teardown ----------------------------------------------------------------
    def stop(self) -> None:
        """Unload every worker we started and close the control channels. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._loop.on_loop_thread():  # engine.close() from an event listener
            threading.Thread(target=self._stop_now, name="flotilla-fleet-stop", daemon=True).start()
            return
        self._stop_now()

    def _stop_now(self) -> None:
        try:
            if self._watch is not None:
                try:
                    self._watch.result(2)
                except Exception:
                    self._watch.cancel()
            for st in self._all:
                if st.peer is None:
                    _stop_local(st.proc)
            if self._clients:
                self._loop.call(self._unload_all(), 30)
        except Exception as e:
            log.warning("fleet: stopping the workers: %s", e)
        finally:
            self._loop.stop(10)
            if self._local_dir is not None:
                import shutil

                shutil.rmtree(self._local_dir, ignore_errors=True)

    async def _unload_all(self) -> None:
        async def one(st: _Stage) -> None:
            await self._unload_one(st)

        await asyncio.gather(*(one(st) for st in self._all if st.peer is not None))
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    async def _unload_one(self, st: _Stage) -> None:
        client = self._clients.get(st.peer.node_id) if st.peer is not None else None
        if client is None or not st.data_port:
            return
        st.data_port = 0  # once
        try:
            await client.unload(st.sha256)
        except Exception as e:  # gone, or already stopped (a yield)
            log.info("fleet: unload on %s: %s", st.peer.info.hostname, e)

    def summary(self) -> dict:
        """Peers, plan and timings, as plain data."""
        return {
            "peers": [{"node_id": p.node_id, "host": p.info.hostname, "address": p.host,
                       "fingerprint": p.info.fingerprint, "left_out": self.left_out.get(p.node_id)}
                      for p in self.peers.values()],
            "plan": [{"stage": st.index, "peer": st.host, "node_id": st.peer.node_id if st.peer else None,
                      "device": st.device, "layers": [st.start, st.end], "data_port": st.data_port,
                      "shard_sha256": st.sha256, "sent_bytes": st.sent_bytes} for st in self.stages],
            "recoveries": [r.to_dict() for r in getattr(getattr(self.engine, "recovery", None), "records", [])],
            "predicted_tok_s": round(self.plan.predicted_tok_s, 1) if self.plan else None,
            "weights": plan_weights.plan_precision(self.plan) if self.plan else None,
            "context_length": self.plan.context_length if self.plan else None,
            "streams": self.plan.streams if self.plan else None,
            "user_plan": self.user_plan is not None,
            "timings_s": {k: round(v, 2) for k, v in self.timings.items()},
        }


# ---------------------------------------------------------------- recovery


class FleetRingProvider:
    """The coordinator's re-plan provider on a fleet (engine/pipeline/recovery.py).

    replan(): each lost stage's layers go to the first spare agent (paired, in
    this session, not in the ring, not the one that lost it) that shares its PC
    right now and has room: its shard is sent (skipped when cached) and loaded
    exactly as at launch. When none can, and LaunchConfig.local_fallback
    allows, a local shard worker on this PC takes them (CURVE under this
    controller's key, which every agent's worker admits). Else
    RecoveryImpossible says why for each candidate. retire(): unload the old
    workers on their agents (a yielding agent may stop at once) / stop local
    ones; it does not wait (it runs on the coordinator thread)."""

    def __init__(self, session: FleetSession) -> None:
        self.session = session
        self.replacements: list[dict] = []  # what replan() did, for status and tests

    def replan(self, loss: Any) -> list[Any]:
        from engine.pipeline.recovery import RecoveryImpossible

        s = self.session
        if s._stopped:
            raise RecoveryImpossible("the fleet session is closed")
        by_link = {id(st.link): st for st in s._all if st.link is not None}
        ring = [by_link.get(id(link)) for link in loss.stages]
        if any(st is None for st in ring):
            raise RecoveryImpossible("the ring has stages this fleet session did not start")
        for i in loss.lost:
            t = time.monotonic()
            new = self._replace(ring, i)
            ring[i] = new
            self.replacements.append({"stage": i, "layers": [new.start, new.end], "host": new.host,
                                      "node_id": new.peer.node_id if new.peer else None,
                                      "sent_bytes": new.sent_bytes, "seconds": round(time.monotonic() - t, 3)})
        for k, st in enumerate(ring):
            st.index = k
        s.stages = ring
        return [st.link for st in ring]

    def retire(self, links: Any, reason: str) -> None:
        s = self.session
        gone = {id(link) for link in links}
        for st in s._all:
            if st.link is None or id(st.link) not in gone:
                continue
            if st.peer is None:
                threading.Thread(target=_stop_local, args=(st.proc,), daemon=True).start()
            elif not s._stopped:
                s._loop.submit(s._unload_one(st))

    # -- choosing and starting a replacement ------------------------------------
    def _replace(self, ring: list[_Stage], i: int) -> _Stage:
        from engine.pipeline.recovery import RecoveryImpossible

        s, old = self.session, ring[i]
        busy = {st.peer.node_id for k, st in enumerate(ring) if st.peer is not None and k != i}
        why: list[str] = []
        for peer in s.peers.values():
            name = peer.info.hostname
            if old.peer is not None and peer.node_id == old.peer.node_id:
                why.append(f"{name}: it lost the stage")
                continue
            if peer.node_id in busy:
                why.append(f"{name}: already hosts a stage")
                continue
            try:
                new = self._try_peer(ring, i, peer)
            except RecoveryImpossible as e:
                why.append(f"{name}: {e}")
                continue
            except StageRefused as e:  # the agent said why, in fields
                why.append(f"{name}: {'; '.join(r.why() for r in e.refusals)}")
                continue
            except Exception as e:  # noqa: BLE001 - next candidate
                log.warning("fleet: stage %d onto %s failed: %s", i, name, e)
                why.append(f"{name}: {_one_line(e)}")
                continue
            log.warning("fleet: layers %d–%d now on %s", new.start, new.end, name)
            return new
        if s.cfg.local_fallback:
            try:
                return self._start_local(old)
            except Exception as e:  # noqa: BLE001
                why.append(f"this PC: {_one_line(e)}")
        else:
            why.append("this PC: not allowed to host stages (local_fallback is off)")
        raise RecoveryImpossible(f"nothing can host layers {old.start}–{old.end} any more "
                                 f"({'; '.join(why) or 'no other peer'})")

    def _try_peer(self, ring: list[_Stage], i: int, peer: Peer) -> _Stage:
        from engine.pipeline.plan_validate import validate_plan
        from engine.pipeline.recovery import RecoveryImpossible

        s, old = self.session, ring[i]
        client = s._clients.get(peer.node_id)
        if client is None:
            raise RecoveryImpossible("no control channel")
        status = s._loop.call(client.status(), 10)
        s.statuses[peer.node_id] = status
        if not status.sharing:
            raise RecoveryImpossible(f"not sharing now: {status.reason}")
        prof = peer_profile(peer, status)
        kinds = [d for kind in s.cfg.device_preference for d in prof.devices if d.kind == kind]
        if not kinds:
            raise RecoveryImpossible(f"offers no device of kinds {', '.join(s.cfg.device_preference)}")
        # Fit: the ring with this peer in place of the lost stage (the others assumed to fit, as they run).
        profiles, specs = [prof], []
        for k, st in enumerate(ring):
            if k == i:
                specs.append((prof.peer_id, kinds[0].name, st.start, st.end))
            else:
                pid = f"ring-{k}"
                profiles.append(PeerProfile(pid, pid, (DeviceProfile("CPU", "CPU"),), 1 << 50))
                specs.append((pid, "CPU", st.start, st.end))
        issues = validate_plan(specs, s._plan_model, profiles, s._plan_request)
        if issues:
            raise RecoveryImpossible("; ".join(x.message for x in issues))
        new = _Stage(i, peer, kinds[0].name, old.start, old.end, old.bundle, old.sha256,
                     shard_path=old.shard_path)
        s._loop.call(s._send_one(new), None)
        s._loop.call(s._load_one(new), s.cfg.load_timeout_s + 10)
        from engine.pipeline.coordinator import StageLink

        new.link = StageLink(i, new.start, new.end, peer.endpoint(new.data_port), proc=new.proc, pid=new.pid,
                             server_key=peer.info.public_key)
        return new

    def _start_local(self, old: _Stage) -> _Stage:
        """A shard worker on this PC, started the way the local runner starts them."""
        from engine.transport.curve_data import write_curve_file
        from engine.fleet.paths import ensure_private_dir, write_private
        from engine.models.demo import cache_root
        from engine.pipeline.coordinator import StageLink
        from engine.pipeline.runner import REPO_ROOT

        s = self.session
        if old.shard_path is None:
            raise FleetError("the shard is not on this PC")
        if s._local_dir is None:
            s._local_dir = ensure_private_dir(Path(tempfile.mkdtemp(prefix="flotilla-fleet-local-")))
            write_private(s._local_dir / "node.secret", s.keys.secret + "\n")
        # It feeds / is fed by agents' workers: admit every agent of the session (and us).
        allow = [p.info.public_key for p in s.peers.values()] + [s.keys.public]
        n = len(s._all)
        curve = write_curve_file(s._local_dir / f"local-{n}.curve.json", s._local_dir / "node.secret", allow)
        cmd = [sys.executable, "-m", "engine.pipeline.worker", "--shard", str(old.shard_path),
               "--bind", f"tcp://{s._host}:*", "--name", f"stage {old.index} (this PC)", "--device", "CPU",
               "--cache-dir", str(cache_root() / "ov-blobs"), "--parent-pid", str(os.getpid()),
               "--curve", str(curve)] + (["--exact"] if s.cfg.exact else [])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        log_path = s._local_dir / f"local-{n}.log"
        with open(log_path, "ab") as logf:
            proc = process.spawn(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=logf, env=env,
                                 cwd=str(REPO_ROOT), die_with_us=True)
        new = _Stage(old.index, None, "CPU", old.start, old.end, old.bundle, old.sha256,
                     shard_path=old.shard_path, proc=proc, pid=proc.pid)
        s._all.append(new)
        line: list[bytes] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(s.cfg.load_timeout_s)
        try:
            new.endpoint = str(json.loads(line[0])["endpoint"]) if line and line[0] else ""
        except (ValueError, KeyError, TypeError):
            new.endpoint = ""
        if not new.endpoint:
            _stop_local(proc)
            raise FleetError(f"the local worker did not start (log: {log_path})")
        proc.stdout.close()
        log.warning("fleet: layers %d–%d now on this PC (pid %d)", old.start, old.end, proc.pid)
        new.link = StageLink(old.index, old.start, old.end, new.endpoint, proc=proc, log_path=log_path,
                             server_key=s.keys.public)
        return new


def _stop_local(proc: Any) -> None:
    """Stop a worker this PC started (a RemoteWorker or None: nothing to do here)."""
    if proc is None or not isinstance(proc, subprocess.Popen):
        return
    process.stop(proc, LOCAL_STOP_GRACE_S)


def _exit_code(ev: AgentEvent) -> int:
    """The exit an agent reported, as a Popen returncode (a yield = SIGTERM)."""
    import signal

    if ev.event == "worker_exit":
        try:
            return int(ev.detail.rsplit(" ", 1)[-1])
        except ValueError:
            return 1
    return -int(signal.SIGTERM)


def _log_migration(fut: Any, msg: str) -> None:
    try:
        rec = fut.result()
        log.warning("fleet: %s: migrated in %.2f s", msg, rec.resume_s)
    except Exception as e:  # noqa: BLE001
        log.warning("fleet: %s: migration failed: %s", msg, e)


def _refused(st: _Stage, e: AgentRefused, step: str) -> FleetError:
    """The error for an agent's answer refusing st at step: a StageRefused from the
    Refusal's fields when it said why; else a FleetError naming the peer with its message."""
    refusal = e.refusal
    if refusal is not None:
        log.warning("fleet: %s refused stage %d at %s: %s", st.peer.info.hostname, st.index, step, e.reply.message)
        return StageRefused([StageRefusal(st.index, st.start, st.end, st.peer.info.hostname,
                                          st.peer.info.fingerprint, st.device, step, refusal)])
    peer = f"{st.peer.info.hostname} ({st.peer.info.fingerprint})"
    return FleetError(f"{peer} cannot take stage {st.index} (layers {st.start}–{st.end}): "
                      f"{e.reply.message} ({e.code})")


def _raise_refusals(results: Sequence[Any]) -> None:
    """Of gathered per-stage results: nothing when no stage failed; every stage's refusal
    as one StageRefused when all failures are refusals; else one FleetError with every
    failure's line (an unexpected exception as itself)."""
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return
    if all(isinstance(e, StageRefused) for e in errors):
        raise StageRefused([r for e in errors for r in e.refusals])
    odd = [e for e in errors if not isinstance(e, FleetError)]
    if odd or len(errors) == 1:
        raise (odd or errors)[0]
    raise FleetError("; ".join(_one_line(e) for e in errors))


def _one_line(e: BaseException) -> str:
    return (" ".join(str(e).split()) or type(e).__name__)[:200]


def _load_tokenizer(model_path: Path) -> Any:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_path))
    except Exception:  # PipelineEngine tries again and reports it
        return None


def _break_engine(engine: Any, reason: str) -> None:
    """End every request of the engine with reason and refuse new ones."""
    brk = getattr(engine, "_break", None)
    if brk is None:
        return
    if not getattr(engine, "_broken", None):
        brk(reason)
    wake = getattr(engine, "_wake", None)
    if wake is not None:
        wake()


def launch_fleet(keys: KeyPair, peers: Sequence[Peer], cfg: LaunchConfig = LaunchConfig(),
                 progress: Progress | None = None,
                 on_event: Callable[[FleetEvent], None] | None = None, *, plan: Plan | None = None) -> Any:
    """Launch `plan` as is (checked, never re-planned), or plan over the peers;
    send the shards, start the workers, wire a PipelineEngine; engine.close()
    unloads everything. Raises PlanError before anything is sent when the plan
    does not fit (naming the stage), StageRefused (a PlanError) when agents
    refuse stages (their Refusal fields in .refusals), NotPaired for an agent
    that does not know our key, FleetError/EngineError for anything else (after cleaning up)."""
    session = FleetSession(keys, peers, cfg, progress, plan=plan)
    if on_event is not None:
        session.add_listener(on_event)
    return session.launch()


__all__ = ["FleetEvent", "FleetRingProvider", "FleetSession", "RemoteWorker", "LaunchConfig", "StageRefused",
           "async_discover", "async_pair_all",
           "controller_keys", "launch_fleet", "local_address_toward", "peer_links", "peer_profile"]
