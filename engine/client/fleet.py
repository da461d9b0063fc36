"""The fleet as the app sees it: this PC, live discovery, pairing, peers added by address, launching on agents."""

from __future__ import annotations

import importlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from engine.client._common import Progress, one_line
from engine.client.launch import LaunchCancelled, LaunchStep
from engine.client.settings import config_dir, load_sharing_policy
from engine.core.interface import Engine, EngineError

if TYPE_CHECKING:
    import queue

    from engine.aio import LoopThread
    from engine.fleet.discovery import ManualPeers, Peer
    from engine.fleet.launch_reports import StageProgress
    from engine.planner.plan import Plan
    from engine.transport.security import KeyPair


@dataclass(frozen=True)
class PeerCard:
    """One peer as the Fleet view shows it: this PC, an agent found over mDNS,
    or one added by address (polled on its info port)."""

    peer_id: str  # node id, or "this-pc", or "manual:<address>" for one that never answered
    name: str  # hostname or the address typed
    os: str  # "Linux 6.8"; "" if unknown
    devices: tuple[str, ...]  # OpenVINO device names: ("CPU", "GPU.0", "NPU")
    ram_total: int  # bytes; 0 if unknown
    ram_free: int  # bytes available now (the planner's budget for this peer)
    idle_since: float | None  # unix time the user was last active; None if unknown
    sharing: str  # the sharing state in a few words
    paired: bool | None  # this app's key is on the agent's allow-list; None = this PC / unknown
    local: bool  # this PC
    reachable: bool  # answered just now
    reason: str = ""  # why not reachable / not usable
    address: str = ""  # host:port (the agent's base port)
    device_names: tuple[str, ...] = field(default=())  # full device names, same order as devices
    source: str = "this-pc"  # "this-pc" | "mdns" | "manual"
    fingerprint: str = ""  # the agent's key fingerprint (16 hex), what people compare
    public_key: str = ""  # the agent's CurveZMQ public key (Z85)
    sharing_now: bool | None = None  # the agent's own decision (Status; paired peers only)
    handle: Peer | None = field(default=None, compare=False, repr=False)  # the fleet's own Peer (pairing, launch)


@dataclass(frozen=True)
class FleetChange:
    """One event of watch_fleet()."""

    kind: str  # "ready" | "added" | "updated" | "removed" | "error"
    card: PeerCard | None = None  # the peer (added/updated/removed)
    message: str = ""  # for "ready" (what is watched) and "error"


def this_pc() -> PeerCard:
    """This PC from psutil and OpenVINO. Blocking (~0.5 s the first time: OpenVINO)."""
    from engine.fleet import sysinfo

    total, avail = sysinfo.ram()
    devs = sysinfo.openvino_devices()
    policy = load_sharing_policy()
    idle_since = None
    try:
        from engine.fleet.idle import default_idle_source

        idle = default_idle_source().idle_seconds()
        idle_since = None if idle is None else time.time() - idle
    except Exception:
        pass
    return PeerCard(
        peer_id="this-pc", name=f"{sysinfo.hostname()} (this PC)", os=sysinfo.os_name(),
        devices=tuple(d.name for d in devs), device_names=tuple(d.full_name for d in devs),
        ram_total=total, ram_free=avail, idle_since=idle_since,
        sharing=_policy_words(policy), paired=None, local=True, reachable=True)


def _policy_words(p: dict) -> str:
    if not p.get("enabled", True):
        return "not shared"
    parts = [f"after {float(p.get('idle_minutes', 5)):g} min idle", f"≤ {float(p.get('max_ram_gb', 8)):g} GB"]
    if p.get("require_ac", True):
        parts.append("on AC")
    return "shared " + ", ".join(parts)


def controller_name() -> str:
    """How this app introduces itself when it asks an agent to pair."""
    from engine.fleet import sysinfo

    return f"Flotilla app on {sysinfo.hostname()}"[:255]


def _controller_keys() -> KeyPair:
    from engine.transport.security import KeyPair

    return KeyPair.load_or_create(config_dir())  # the same node key launch.controller_keys() uses


def pairing_code_for(card: PeerCard) -> str:
    """The 6 digits this app shows for pairing with card's agent (computed here,
    from both public keys, never taken from the agent). Reads our key: blocking."""
    from engine.transport.security import pairing_code

    return pairing_code(card.public_key, _controller_keys().public)


def _card(peer: Peer, paired: bool | None, sharing_now: bool | None, why: str) -> PeerCard:
    i = peer.info
    host = peer.host  # the address that answered, best first
    address = f"[{host}]:{i.control_port}" if ":" in host else f"{host}:{i.control_port}"
    if paired and sharing_now:
        sharing = "sharing now"
    elif paired and sharing_now is False:
        sharing = f"not sharing now: {why}" if why else "not sharing now"
    else:
        sharing = "owner away, offered to the fleet" if i.idle else "in use by its owner"
    reason = ""
    if paired is False:
        reason = "not paired: pair it to plan and launch on it"
    elif paired is None and why:
        reason = why
    return PeerCard(i.node_id, i.hostname, i.os, tuple(d.name for d in i.devices), i.ram_total,
                    i.ram_available, i.idle_since, sharing, paired, False, True, reason=reason,
                    address=address, device_names=tuple(d.full_name for d in i.devices),
                    source=peer.source, fingerprint=i.fingerprint, public_key=i.public_key,
                    sharing_now=sharing_now, handle=peer)


async def _probe(keys: KeyPair, peer: Peer, timeout: float = 3.0) -> tuple[bool | None, bool | None, str]:
    """(paired, sharing now, why) of one agent, from a CURVE handshake on its
    control port: the agent's ZAP admits allow-listed keys only, so this tells
    paired from not paired without asking anything of the owner."""
    from engine.fleet.client import AgentClient, NotPaired

    client = AgentClient(keys, peer.endpoint(), peer.info.public_key, timeout=timeout)
    try:
        await client.async_connect()
        status = await client.status()
        return True, status.sharing, status.reason
    except NotPaired:
        return False, None, ""
    except Exception as e:
        return None, None, f"its control port does not answer ({one_line(e)})"
    finally:
        client.close()


class FleetWatcher:
    """Live fleet discovery for the app: mDNS (on `interfaces`; None = all,
    what real users get; tests pass ["127.0.0.1"]) plus the peers added by
    address (manual_peers.json, polled on their info port). Each agent found is
    probed for its pairing state with this app's key.

    events(stop) is a generator for the app's Runner: it runs the discovery on
    a private asyncio loop thread and yields FleetChange until stop is set.
    add_address/remove_address/refresh may be called from any thread."""

    PROBE_EVERY_S = 10.0  # re-check pairing/sharing state on TXT updates at most this often

    def __init__(self, interfaces: Sequence[str] | None = None, *, mdns: bool = True,
                 manual_interval: float = 5.0) -> None:
        self.interfaces = list(interfaces) if interfaces else None
        self.mdns, self.manual_interval = mdns, manual_interval
        self._loop: LoopThread | None = None
        self._manual: ManualPeers | None = None
        self._queue: queue.Queue[FleetChange] | None = None
        self._probed: dict[str, tuple[float, tuple]] = {}  # node_id -> (when, probe result)
        self._keys: KeyPair | None = None

    def events(self, stop: threading.Event):  # -> Iterator[FleetChange]
        import queue

        from engine.aio import LoopThread
        from engine.fleet.discovery import Combined, ManualPeers
        from engine.fleet.mdns import MdnsDiscovery

        self._queue = q = queue.Queue()
        self._loop = loop = LoopThread("flotilla-app-fleet")

        def run(coro: Any, timeout: float = 15.0) -> Any:
            return loop.call(coro, timeout)

        disc = None
        try:
            self._keys = _controller_keys()
            parts = []
            if self.mdns:
                parts.append(MdnsDiscovery(self.interfaces, own_node_id=_own_node_id()))
            self._manual = ManualPeers(config_dir(), interval=self.manual_interval, misses=2)
            parts.append(self._manual)
            disc = Combined(*parts)
            disc.add_listener(self._on_peer)
            try:
                run(disc.async_start())
            except Exception as e:
                yield FleetChange("error", message=f"cannot start discovery: {one_line(e)}")
                return
            where = ("mDNS on " + (", ".join(self.interfaces) if self.interfaces else "all interfaces")
                     if self.mdns else "mDNS off")
            yield FleetChange("ready", message=where)
            while not stop.is_set():
                try:
                    yield q.get(timeout=0.2)
                except queue.Empty:
                    continue
        finally:
            try:
                if disc is not None:
                    run(disc.async_close(), 10)
            except Exception:
                pass
            loop.stop()
            self._loop = None

    # -- on the loop thread ------------------------------------------------------
    def _on_peer(self, kind: str, peer: Peer) -> None:
        if kind == "removed":
            self._probed.pop(peer.node_id, None)
            self._queue.put(FleetChange("removed", _card(peer, None, None, "")))
            return
        import asyncio

        asyncio.get_running_loop().create_task(self._report(kind, peer))

    async def _report(self, kind: str, peer: Peer, force: bool = False) -> None:
        last = self._probed.get(peer.node_id)
        if force or last is None or time.monotonic() - last[0] > self.PROBE_EVERY_S:
            result = await _probe(self._keys, peer)
            self._probed[peer.node_id] = (time.monotonic(), result)
        else:
            result = last[1]
        self._queue.put(FleetChange(kind, _card(peer, *result)))

    # -- from any thread ----------------------------------------------------------
    def _call(self, fn: Callable[[], Any]) -> Any:
        loop = self._loop
        if loop is None:
            return fn()

        async def on_loop() -> Any:
            return fn()

        return loop.call(on_loop(), 10)

    def add_address(self, text: str) -> str:
        """Validate and remember host[:port] (persisted); polled at once. ValueError if malformed."""
        entry = add_peer_address(text)
        if self._manual is not None:
            self._call(lambda: self._manual.add(entry))
        return entry

    def remove_address(self, entry: str) -> None:
        remove_peer_address(entry)
        if self._manual is not None:
            self._call(lambda: self._manual.remove(entry))

    def refresh(self, card: PeerCard) -> None:
        """Probe a peer again now (after pairing); an "updated" change follows."""
        loop = self._loop
        if loop is not None and card.handle is not None:
            loop.submit(self._report("updated", card.handle, force=True))


def _own_node_id() -> str | None:
    """This PC's agent node id, if an agent ever ran here (its own announcements are skipped)."""
    from engine.fleet.identity import IDENTITY_FILE
    from engine.fleet.paths import read_json

    data = read_json(config_dir() / IDENTITY_FILE, {})
    node = data.get("node_id") if isinstance(data, dict) else None
    return node if isinstance(node, str) else None


def pair_peer(card: PeerCard, progress: Progress | None = None, cancel: threading.Event | None = None,
              wait_s: float = 600.0) -> str:
    """Ask card's agent to pair with this app and wait for its owner to accept.

    Blocking. First reports (code, 0.0): show the code and tell the user to
    compare it with the agent's tray (or type it in `flotilla agent pair
    --accept CODE` there). Returns "accepted"; raises LaunchCancelled-like
    EngineError("pairing cancelled") on cancel, EngineError on timeout or
    when the codes differ (someone in the middle)."""
    import asyncio

    from engine import aio
    from engine.fleet.client import FleetError, async_pair
    from engine.transport.security import KNOWN_AGENTS_FILE, KeyBook, pairing_code

    peer = card.handle
    if peer is None or not card.public_key:
        raise EngineError(f"{card.name} has not announced its key yet: wait for it to answer")
    keys = _controller_keys()
    code = pairing_code(card.public_key, keys.public)
    report = progress or (lambda _m, _f: None)
    report(code, 0.0)
    cancel = cancel or threading.Event()
    name = controller_name()

    async def ask() -> str:
        loop = asyncio.get_running_loop()
        end = loop.time() + wait_s
        while True:
            reply = await async_pair(keys, peer.endpoint(peer.info.pair_port), card.public_key, name,
                                     wait=1.0, poll=0.5)
            if reply.state == "accepted":
                return "accepted"
            if cancel.is_set():
                return "cancelled"
            if loop.time() >= end:
                return "timeout"
            report(code, min(0.99, 1.0 - (end - loop.time()) / wait_s))

    try:
        state = aio.run(ask())
    except FleetError as e:
        raise EngineError(str(e)) from None
    if state == "cancelled":
        raise EngineError("pairing cancelled")
    if state == "timeout":
        raise EngineError(f"{card.name}'s owner did not accept within {wait_s / 60:.0f} minutes")
    KeyBook(config_dir() / KNOWN_AGENTS_FILE).add(card.public_key, card.name)
    return state


def fleet_launch_available() -> tuple[bool, str]:
    """Can the app launch a pipeline on fleet agents (engine/fleet/launch.py)?"""
    try:
        where = {n: importlib.import_module(m) for n, m in (("FleetSession", "engine.fleet.session"),
                                                            ("LaunchConfig", "engine.fleet.launch_config"))}
    except Exception as e:
        return False, f"the fleet launcher (engine/fleet/launch.py) is not available: {one_line(e)}"
    missing = [n for n, mod in where.items() if not hasattr(mod, n)]
    if missing:
        return False, f"the fleet launcher lacks {', '.join(missing)}"
    return True, ""


def launch_fleet(spec: str, plan: Plan, cards: Sequence[PeerCard],
                 step: Callable[[LaunchStep], None] | None = None,
                 cancel: threading.Event | None = None, prompt_cache_exact: bool = False) -> Engine:
    """Launch `plan` (a Plan over fleet_peers(), as the plan editor shows it:
    per-stage node id and device, ranges, weight precision, context, streams)
    on fleet agents through engine/fleet/launch.py, as is: the launcher checks
    it against the agents' fresh status and refuses (PlanError naming the
    stage, before any shard is exported or sent) when it no longer fits; it
    never re-plans. Then the shards are sent (resumable), workers loaded, a
    CURVE PipelineEngine wired. Blocking; per-stage LaunchStep like
    launch_pipeline. Setting `cancel` stops at the next step (everything
    started is unloaded) with LaunchCancelled. `prompt_cache_exact`: follow-ups reuse
    whole prefill chunks and the agents start their workers with a 16-bit KV cache."""
    from engine.fleet.launch_config import LaunchConfig
    from engine.fleet.session import FleetSession

    by_id = {c.peer_id: c for c in cards}
    missing = [s.peer_id for s in plan.stages if s.peer_id not in by_id or by_id[s.peer_id].handle is None]
    if missing:
        raise EngineError(f"peer(s) gone from the fleet: {', '.join(missing)}")
    peers = [by_id[pid].handle for pid in dict.fromkeys(s.peer_id for s in plan.stages)]
    report = step or (lambda _s: None)
    cancel = cancel or threading.Event()
    n = len(plan.stages)
    for i in range(n):
        report(LaunchStep(i, "waiting", 0.0, "waiting"))

    def progress(_message: str, _fraction: float) -> None:  # the words are for logs: only cancel here
        if cancel.is_set():
            raise LaunchCancelled("launch cancelled")

    def on_stage(p: StageProgress) -> None:
        if not 0 <= p.stage < n:
            return
        if p.phase == "start":
            report(LaunchStep(p.stage, "compile", 0.5, p.message))
        else:  # export/pack the shard, then send it (or the peer has it): the first 40 % of a stage's bar
            done = {"send": p.fraction, "have": 1.0}.get(p.phase, 0.0)
            report(LaunchStep(p.stage, "transfer", 0.4 * done, p.message))

    cfg = LaunchConfig(model=spec, stages=n, weights=plan.weight_precision, context_length=plan.context_length,
                       max_concurrent=plan.streams, prompt_cache_exact=prompt_cache_exact)
    session = FleetSession(_controller_keys(), peers, cfg, progress, plan=plan, on_stage=on_stage)
    try:
        engine = session.launch()
    except LaunchCancelled:
        raise
    except Exception as e:
        from engine.planner.plan import PlanError

        if cancel.is_set():
            raise LaunchCancelled("launch cancelled") from None
        if isinstance(e, (EngineError, PlanError)):
            raise
        raise EngineError(one_line(e)) from None
    if cancel.is_set():
        engine.close()
        raise LaunchCancelled("launch cancelled")
    for i in range(n):
        report(LaunchStep(i, "ready", 1.0, "ready"))
    engine.launched_at = time.monotonic()  # type: ignore[attr-defined]
    return engine


def _manual_file() -> Path:
    from engine.fleet.discovery import MANUAL_FILE

    return config_dir() / MANUAL_FILE  # the same file the fleet's ManualPeers reads


def peer_addresses() -> list[str]:
    """Peers added by address ("host:port"), persisted for the fleet agent too."""
    try:
        data = json.loads(_manual_file().read_text())
    except (OSError, ValueError):
        return []
    return [a for a in data if isinstance(a, str)] if isinstance(data, list) else []


def add_peer_address(text: str) -> str:
    """Validate and remember host[:port]; returns the normalised entry. ValueError if malformed."""
    from engine.fleet.discovery import parse_hostport
    from engine.fleet.paths import write_json

    host, port = parse_hostport(text)
    entry = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    entries = peer_addresses()
    if entry not in entries:
        write_json(_manual_file(), entries + [entry])
    return entry


def remove_peer_address(entry: str) -> None:
    from engine.fleet.paths import write_json

    write_json(_manual_file(), [a for a in peer_addresses() if a != entry])
