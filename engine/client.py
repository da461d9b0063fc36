"""The engine facade for the desktop app.

This is the only engine module, besides engine.protocol, that app/ may import
(import-linter enforces it). Everything the app needs from the engines goes
through a function here, so the engine packages can change shape without the
app noticing, and so one file shows the whole app <-> engine surface:

  engines   engine_kinds, open_engine, launch_pipeline, ring_snapshot, stage_pids
  models    list_models, list_demo_models, model_profile, import_model_folder,
            download_model, convert_to_openvino
  planning  plan_model, local_peers, fleet_peers, plan_request, auto_plan,
            evaluate_plan, move_boundary, exclude_peer, pin_device, balanced_plan
  fleet     fleet_snapshot, peer_addresses, add_peer_address, remove_peer_address
  settings  config_dir, data_dir, sharing_policy_path, load/save_sharing_policy
  API       start_api_server

Heavy imports (torch, OpenVINO, transformers, zmq) happen lazily inside the
functions, so importing this module is cheap and the app can show its window
before any engine code is loaded. No Qt here. Functions marked "blocking" run
on the app's background runner, never on the GUI thread; the planner edits
(move_boundary, evaluate_plan...) are pure and take microseconds, so the plan
editor may call them while the user drags.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

# Light modules (no torch, no OpenVINO): safe to import eagerly for annotations.
from engine.serve.interface import Engine, EngineError, EngineInfo

__all__ = [
    "Engine", "EngineError", "EngineInfo", "EngineKind", "FleetSnapshot", "LaunchCancelled",
    "LaunchStep", "PeerCard", "RingSnapshot", "RingStage", "DownloadPaused",
    "open_engine", "engine_kinds", "launch_pipeline", "ring_snapshot", "stage_pids",
    "list_demo_models", "list_models", "model_profile", "import_model_folder", "download_model",
    "convert_to_openvino", "plan_model", "local_peers", "fleet_peers", "plan_request",
    "auto_plan", "balanced_plan", "evaluate_plan", "move_boundary", "exclude_peer", "pin_device",
    "fleet_snapshot", "peer_addresses", "add_peer_address", "remove_peer_address",
    "config_dir", "data_dir", "sharing_policy_path", "load_sharing_policy", "save_sharing_policy",
    "start_api_server", "speculative_available",
]

Progress = Callable[[str, float], None]  # (what is happening, fraction 0..1)

# The planner's types, imported on first use (numpy): PlanError, Plan, ...
_PLAN_NAMES = {"PlanError", "Plan", "PlanModel", "PlanRequest", "PeerProfile", "DeviceProfile",
               "Stage", "PlanIssue"}


def __getattr__(name: str) -> Any:
    if name in _PLAN_NAMES:
        from engine.pipeline import plan

        return getattr(plan, name)
    raise AttributeError(f"module 'engine.client' has no attribute {name!r}")


# ----------------------------------------------------------------------- engines
@dataclass(frozen=True)
class EngineKind:
    name: str  # the factory key: "local", "pipeline", "moe", "sparse"
    label: str  # what the UI shows
    description: str  # one line from the factory
    available: bool  # its module imports
    reason: str = ""  # why not, when unavailable


# kind -> (module that must import, UI label). Kinds the factory does not know
# yet are still listed, disabled, so the user sees what is coming.
_KIND_MODULES = {
    "pipeline": ("engine.pipeline.runner", "Distributed pipeline"),
    "local": ("engine.serve.local", "Local dense"),
    "moe": ("engine.moe.engine", "Local MoE offload"),
    "sparse": ("engine.sparse.engine", "Local sparse"),
}


def engine_kinds() -> list[EngineKind]:
    """Every engine kind the UI offers, with whether it can open now. Blocking
    (imports each engine's module, which may pull in torch)."""
    from engine.serve.factory import ENGINE_KINDS

    out = []
    for name, (module, label) in _KIND_MODULES.items():
        desc = ENGINE_KINDS[name][1] if name in ENGINE_KINDS else ""
        if name not in ENGINE_KINDS:
            out.append(EngineKind(name, label, desc, False, "not built yet (engine.serve.factory "
                                                            f"has no {name!r} engine)"))
            continue
        try:
            importlib.import_module(module)
        except Exception as e:  # a half-built engine must not take the app down
            out.append(EngineKind(name, label, desc, False,
                                  f"{module} does not import: {_one_line(e)}"))
            continue
        out.append(EngineKind(name, label, desc, True))
    for name, (_opener, desc) in ENGINE_KINDS.items():  # kinds added later by others
        if name not in _KIND_MODULES:
            out.append(EngineKind(name, name.capitalize(), desc, True))
    return out


def speculative_available() -> tuple[bool, str]:
    """Speculative decoding in the pipeline (mask-based rollback): not built yet."""
    try:
        importlib.import_module("engine.pipeline.speculative")
    except Exception:
        return False, "speculative decoding has not landed yet (engine/pipeline/speculative.py)"
    return False, ("speculative decoding (engine/pipeline/speculative.py) is not wired into the "
                   "app's launch yet: it needs a draft model choice in the plan editor")


def open_engine(spec: str = "demo", device: str = "CPU", progress: Progress | None = None,
                kind: str = "local", cache_budget_bytes: int | None = None,
                context_length: int | None = None, streams: int | None = None) -> Engine:
    """Open an engine of `kind` for `spec` (a demo id, a model folder or a hub id).

    Blocking and slow (it may build a demo model and compile it): call it off
    the GUI thread. `progress` is called from that same thread.
    """
    if kind == "local":
        from engine.serve.local import LocalEngine  # lazy: pulls in torch/OpenVINO

        kw: dict[str, Any] = {}
        if context_length:
            kw["context_length"] = context_length
        if streams:
            kw["max_concurrent"] = streams
        return LocalEngine.from_spec(spec, device=device, progress=progress, **kw)
    from engine.serve.factory import EngineOptions, open_engine as factory_open

    return factory_open(spec, kind, EngineOptions(device=device, cache_budget_bytes=cache_budget_bytes),
                        progress)


@dataclass(frozen=True)
class LaunchStep:
    """Progress of one stage while a pipeline launches."""

    stage: int  # ring position; -1 = the whole launch
    phase: str  # "waiting" | "transfer" | "compile" | "ready" | "failed"
    fraction: float  # of the whole launch, 0..1
    message: str  # one line for people


class LaunchCancelled(EngineError):
    """The user cancelled a launch; every stage process was stopped."""


def launch_pipeline(spec: str, ranges: Sequence[tuple[int, int]], device: str = "CPU",
                    context_length: int | None = None, streams: int = 4,
                    step: Callable[[LaunchStep], None] | None = None,
                    cancel: threading.Event | None = None) -> Engine:
    """The steps of engine.pipeline.runner.launch_pipeline (plan, export,
    start, wire), taken one by one so that each stage's progress can be
    reported and a cancel can stop the processes between and during them.

    Start a pipeline of len(ranges) stage processes on this PC (loopback) and
    wire it. Blocking. Reports LaunchStep per stage (transfer = the shard is
    exported/copied into place, compile = the worker loads and compiles it,
    ready). Setting `cancel` stops every process and raises LaunchCancelled.
    PlanError when the plan does not fit, before anything starts."""
    from engine.pipeline.coordinator import PipelineConfig, PipelineEngine
    from engine.pipeline.runner import FleetConfig, LocalFleet, PipelineLaunchError

    report = step or (lambda _s: None)
    cancel = cancel or threading.Event()
    n = len(ranges)
    cfg = FleetConfig(model=spec, stages=n, split=tuple((int(a), int(b)) for a, b in ranges),
                      device=device, context_length=context_length, max_concurrent=max(1, streams))
    for i in range(n):
        report(LaunchStep(i, "waiting", 0.0, "waiting"))

    def on_export(message: str, fraction: float) -> None:
        # LocalFleet.export reports (…, i / n) before stage i and (…, 1.0) at the end.
        i = min(n - 1, int(round(fraction * n)))
        if fraction < 1.0:
            if i > 0:
                report(LaunchStep(i - 1, "transfer", 0.3 * i / n, "shard in place"))
            report(LaunchStep(i, "transfer", 0.3 * fraction, message))
        if cancel.is_set():
            raise LaunchCancelled("launch cancelled")

    fleet = LocalFleet(cfg, on_export)  # plans (may raise PlanError): nothing started yet
    over = threading.Event()
    threading.Thread(target=_stop_on_cancel, args=(cancel, over, fleet), daemon=True).start()
    try:
        infos = fleet.export()
        for i in range(n):
            report(LaunchStep(i, "transfer", 0.3, "shard in place"))
        _check_cancel(cancel)
        links = fleet.launch(infos)
        for i in range(n):
            report(LaunchStep(i, "compile", 0.5, f"worker pid {links[i].proc.pid} compiling"))
        _check_cancel(cancel)
        pcfg = PipelineConfig(max_concurrent=cfg.max_concurrent, prefill_chunk=cfg.prefill_chunk,
                              context_length=fleet.context_length, return_bind=f"tcp://{cfg.host}:*",
                              ready_timeout_s=cfg.ready_timeout_s, device=cfg.device)
        # What runner.launch_pipeline does to wire the ring, kept in step with it:
        # an encrypted ring needs the coordinator's CURVE keys.
        if getattr(fleet, "ring_keys", None) is not None and getattr(pcfg, "curve", None) is None:
            pcfg = dataclasses.replace(pcfg, curve=fleet.ring_keys.coordinator)
        engine = PipelineEngine(links, fleet.model_path, fleet.resolved.model_id, pcfg,
                                on_close=fleet.stop)
        engine.fleet = fleet  # type: ignore[attr-defined]  # ring_snapshot and stage_pids read it
        engine.launched_at = time.monotonic()  # type: ignore[attr-defined]
        if cancel.is_set():
            engine.close()
            raise LaunchCancelled("launch cancelled")
        for i in range(n):
            report(LaunchStep(i, "ready", 1.0, "ready"))
        return engine
    except LaunchCancelled:
        fleet.stop()
        raise
    except PipelineLaunchError as e:
        fleet.stop()
        raise (LaunchCancelled("launch cancelled") if cancel.is_set() else EngineError(str(e))) from None
    except BaseException as e:
        fleet.stop()
        if cancel.is_set():
            raise LaunchCancelled("launch cancelled") from None
        raise e
    finally:
        over.set()  # the stopper thread exits


def _check_cancel(cancel: threading.Event) -> None:
    if cancel.is_set():
        raise LaunchCancelled("launch cancelled")


def _stop_on_cancel(cancel: threading.Event, over: threading.Event, fleet: Any) -> None:
    # PipelineEngine() blocks until every stage answers; a cancel must not wait
    # for that: stopping the processes makes it fail at once.
    while not over.is_set():
        if cancel.wait(0.1):
            if not over.is_set():
                fleet.stop()
            return


@dataclass(frozen=True)
class RingStage:
    index: int
    label: str  # "stage 0"
    start: int  # layers [start, end)
    end: int
    utilisation: float  # share of wall time spent computing since launch, 0..1
    compute_ms: float  # mean compute per step
    alive: bool  # the process still runs


@dataclass(frozen=True)
class RingSnapshot:
    stages: tuple[RingStage, ...]
    link_ms: float  # mean per-hop latency (ring time minus compute, per hop)
    tokens: int  # tokens generated so far
    broken: str | None  # why the ring stopped, if it did


def ring_snapshot(engine: Engine | None) -> RingSnapshot | None:
    """Live timings of a pipeline engine (None for any other engine). Cheap:
    reads counters the coordinator thread keeps; safe from any thread."""
    stats = getattr(engine, "stats", None)
    stages = getattr(engine, "stages", None)
    if engine is None or stats is None or stages is None or engine.info.engine != "pipeline":
        return None
    elapsed = max(1e-3, time.monotonic() - getattr(engine, "launched_at", time.monotonic() - 1.0))
    steps = max(1, stats.steps)
    out = []
    for i, link in enumerate(stages):
        ms = stats.stage_ms[i] if i < len(stats.stage_ms) else 0.0
        alive = link.proc.poll() is None if link.proc is not None else True
        out.append(RingStage(i, f"stage {i}", link.start, link.end, min(1.0, ms / 1000.0 / elapsed),
                             ms / steps, alive))
    hops = max(1, len(stages))
    link_ms = max(0.0, (stats.ring_ms - sum(stats.stage_ms)) / steps / hops) if stats.steps else 0.0
    return RingSnapshot(tuple(out), link_ms, stats.tokens, getattr(engine, "_broken", None))


def stage_pids(engine: Engine | None) -> list[int]:
    """Process ids of a local pipeline's stage workers (empty for other engines)."""
    return [link.proc.pid for link in getattr(engine, "stages", []) or [] if link.proc is not None]


# ----------------------------------------------------------------------- models
def list_demo_models() -> list[str]:
    """The demo model ids, in the order the UI should offer them."""
    from engine.models.demo import demo_ids

    return list(demo_ids())


def list_models() -> list[Any]:
    """engine.models.LocalModelEntry for demos, the HF cache, added folders and
    OpenVINO IR folders. Blocking (reads folder sizes)."""
    from engine.models import list_local_models

    return list_local_models()


def model_profile(spec: str, progress: Progress | None = None) -> Any:
    """engine.models.ModelProfile (layers, bytes, experts) of a model. Blocking;
    builds an unbuilt demo first."""
    from engine.models import profile_model, resolve_model

    return profile_model(resolve_model(spec, progress, allow_download=False))


def import_model_folder(path: str | Path) -> Any:
    """Validate and remember a model folder; its LocalModelEntry. ModelError if unusable."""
    from engine.models import add_model_folder

    return add_model_folder(path)


class DownloadPaused(EngineError):
    """download_model stopped because the user paused; call again to resume."""


def download_model(hub_id: str, progress: Progress | None = None,
                   pause: threading.Event | None = None) -> Path:
    """Download a hub model into the Hugging Face cache. Blocking. Setting
    `pause` stops at the next progress tick with DownloadPaused; calling again
    resumes (huggingface_hub keeps the partial files). ModelError (a sentence
    for the user) when offline, gated or unknown."""
    from engine.models import resolve_model

    def tick(message: str, fraction: float) -> None:
        if pause is not None and pause.is_set():
            raise DownloadPaused(f"download of {hub_id} paused")
        if progress:
            progress(message, fraction)

    tick(f"contacting the hub for {hub_id}", 0.0)
    return Path(resolve_model(hub_id, tick).path)


def convert_to_openvino(spec: str, progress: Progress | None = None) -> Path:
    """Export a Hugging Face model to an OpenVINO IR folder (cached; the local
    engine then loads it without converting). Blocking. Returns the IR folder."""
    from engine.models import resolve_model
    from engine.runtime.ov_backend import ensure_ir

    report = progress or (lambda _m, _f: None)
    resolved = resolve_model(spec, progress, allow_download=False)
    report(f"converting {resolved.model_id}", 0.05)
    path = ensure_ir(Path(resolved.path), progress=report)
    report(f"OpenVINO IR ready in {path}", 1.0)
    return path


# ----------------------------------------------------------------------- planning
def plan_model(spec: str) -> Any:
    """(PlanModel, ModelProfile) for a model: what the planner partitions. Blocking."""
    from engine.pipeline.plan import PlanModel

    profile = model_profile(spec)
    return PlanModel.from_profile(profile), profile


def local_peers(count: int, card: "PeerCard | None" = None) -> list[Any]:
    """`count` simulated stages on this PC ("this PC ×N"): PeerProfiles that
    share this PC's free RAM equally and offer its devices. The local runner
    starts one real worker process per stage on loopback."""
    from engine.pipeline.plan import DEVICE_KINDS, DeviceProfile, PeerProfile

    card = card or this_pc()
    devices = tuple(DeviceProfile(d.split(".")[0] if d.split(".")[0] in DEVICE_KINDS else "CPU", d)
                    for d in card.devices) or (DeviceProfile("CPU", "CPU"),)
    share = card.ram_free // max(1, count)
    return [PeerProfile(f"local-{i}", f"This PC #{i + 1}" if count > 1 else "This PC", devices, share)
            for i in range(count)]


def fleet_peers(cards: Sequence["PeerCard"]) -> list[Any]:
    """PeerProfiles for the planner from reachable fleet cards."""
    from engine.pipeline.plan import DEVICE_KINDS, DeviceProfile, PeerProfile

    out = []
    for c in cards:
        if not c.reachable:
            continue
        devs = tuple(DeviceProfile(d.split(".")[0], d) for d in c.devices if d.split(".")[0] in DEVICE_KINDS)
        out.append(PeerProfile(c.peer_id, c.name, devs or (DeviceProfile("CPU", "CPU"),), c.ram_free))
    return out


def plan_request(context_length: int = 4096, streams: int = 1, weight_precision: str = "native") -> Any:
    from engine.pipeline.plan import PlanRequest

    return PlanRequest(context_length=context_length, streams=streams, weight_precision=weight_precision)


def auto_plan(model: Any, peers: Sequence[Any], request: Any,
              pinned: dict[str, str] | None = None) -> Any:
    """The planner's best plan (PlanError with the reason when nothing fits)."""
    from engine.pipeline.plan import auto_plan as plan

    return plan(model, peers, request, pinned_devices=pinned)


def balanced_plan(model: Any, peers: Sequence[Any], request: Any,
                  devices: dict[str, str] | None = None) -> Any:
    """A plan over exactly these peers in this order, layers split so the
    largest stage (by weight bytes) is as small as possible. The planner would
    put a small model on one of N equal local stages (fewest peers win a tie);
    this keeps all N, which is what "this PC ×N" is for."""
    from engine.pipeline.plan_validate import evaluate_plan as evaluate

    sizes = list(model.bytes_per_layer)
    n = min(len(peers), len(sizes))
    cuts = _linear_partition(sizes, n)
    bounds = [0, *cuts, len(sizes)]
    devices = devices or {}
    specs = [(p.peer_id, devices.get(p.peer_id) or p.devices[0].name, bounds[i], bounds[i + 1])
             for i, p in enumerate(peers[:n])]
    return evaluate(specs, model, peers, request)


def _linear_partition(sizes: list[int], parts: int) -> list[int]:
    """Cut points splitting sizes into `parts` contiguous runs minimising the largest sum."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for e in range(k, n + 1):
            for s in range(k - 1, e):
                v = max(best[k - 1][s], prefix[e] - prefix[s])
                if v < best[k][e]:
                    best[k][e], cut[k][e] = v, s
    out, e = [], n
    for k in range(parts, 1, -1):
        e = cut[k][e]
        out.append(e)
    return sorted(out)


def evaluate_plan(stages: Any, model: Any, peers: Sequence[Any], request: Any) -> Any:
    from engine.pipeline.plan_validate import evaluate_plan as evaluate

    return evaluate(stages, model, peers, request)


def validate_plan(stages: Any, model: Any, peers: Sequence[Any], request: Any) -> list[Any]:
    from engine.pipeline.plan_validate import validate_plan as validate

    return validate(stages, model, peers, request)


def move_boundary(plan: Any, index: int, layer: int, model: Any, peers: Sequence[Any], request: Any) -> Any:
    from engine.pipeline.plan_validate import move_boundary as move

    return move(plan, index, layer, model, peers, request)


def exclude_peer(plan: Any, peer_id: str, model: Any, peers: Sequence[Any], request: Any) -> Any:
    from engine.pipeline.plan_validate import exclude_peer as exclude

    return exclude(plan, peer_id, model, peers, request)


def pin_device(plan: Any, peer_id: str, device: str, model: Any, peers: Sequence[Any], request: Any) -> Any:
    from engine.pipeline.plan_validate import pin_device as pin

    return pin(plan, peer_id, device, model, peers, request)


# ----------------------------------------------------------------------- fleet
@dataclass(frozen=True)
class PeerCard:
    """One peer as the Fleet view shows it. Discovered peers (mDNS, once the
    fleet controller lands) plug in as more of these from fleet_snapshot()."""

    peer_id: str  # node id, or "this-pc", or "manual:<address>"
    name: str  # hostname or the address typed
    os: str  # "Linux 6.8"; "" if unknown
    devices: tuple[str, ...]  # OpenVINO device names: ("CPU", "GPU.0", "NPU")
    ram_total: int  # bytes; 0 if unknown
    ram_free: int  # bytes available now (the planner's budget for this peer)
    idle_since: float | None  # unix time the user was last active; None if unknown
    sharing: str  # the sharing policy in a few words
    paired: bool | None  # None for this PC (no pairing with oneself)
    local: bool  # this PC
    reachable: bool  # answered just now
    reason: str = ""  # why not reachable / not usable
    address: str = ""  # host:port for manual peers
    device_names: tuple[str, ...] = field(default=())  # full device names, same order as devices


@dataclass(frozen=True)
class FleetSnapshot:
    peers: tuple[PeerCard, ...]  # this PC first
    discovery_available: bool  # mDNS browsing from the app
    discovery_reason: str  # why not
    pairing_available: bool
    pairing_reason: str


_DISCOVERY_REASON = ("discovering peers on the LAN (mDNS) comes with the fleet controller, "
                     "which is not in the app yet; add a peer by its address meanwhile")
_PAIRING_REASON = "pairing from the app comes with the fleet controller (engine/fleet)"


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


def fleet_snapshot(timeout_s: float = 0.7) -> FleetSnapshot:
    """This PC plus every peer added by address, each asked for its info now.
    Blocking (at most ~timeout_s for unanswered peers, asked in parallel)."""
    cards = [this_pc()]
    addrs = peer_addresses()
    if addrs:
        cards += _query_manual(addrs, timeout_s)
    return FleetSnapshot(tuple(cards), False, _DISCOVERY_REASON, False, _PAIRING_REASON)


def _query_manual(addrs: list[str], timeout_s: float) -> list[PeerCard]:
    import asyncio

    import zmq.asyncio

    from engine.fleet.discovery import INFO_OFFSET, async_query_info, parse_hostport

    async def one(ctx: Any, addr: str) -> PeerCard:
        try:
            host, port = parse_hostport(addr)
            info = await async_query_info(ctx, host, port + INFO_OFFSET, timeout=timeout_s)
        except Exception as e:
            return PeerCard(f"manual:{addr}", addr, "", (), 0, 0, None, "unknown", False, False, False,
                            reason=f"cannot be contacted ({_one_line(e)})", address=addr)
        return PeerCard(info.node_id, info.hostname, info.os, tuple(d.name for d in info.devices),
                        info.ram_total, info.ram_available, info.idle_since,
                        "idle, sharing" if info.idle else "in use by its owner", False, False, True,
                        reason="not paired: " + _PAIRING_REASON, address=addr,
                        device_names=tuple(d.full_name for d in info.devices))

    async def all_() -> list[PeerCard]:
        ctx = zmq.asyncio.Context()
        try:
            return list(await asyncio.gather(*(one(ctx, a) for a in addrs)))
        finally:
            ctx.term()

    return asyncio.run(all_())


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


# ----------------------------------------------------------------------- settings
def config_dir() -> Path:
    """$FLOTILLA_CONFIG, else the platform's per-user config folder (created)."""
    from engine.fleet.paths import config_dir as cfg

    return cfg()


def data_dir() -> Path:
    """Where the app keeps conversations: $FLOTILLA_DATA, else the platform's
    per-user data folder (platformdirs), created if missing."""
    env = os.environ.get("FLOTILLA_DATA")
    if env:
        path = Path(env).expanduser()
    else:
        import platformdirs

        path = Path(platformdirs.user_data_dir("flotilla", appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def sharing_policy_path() -> Path:
    """THE sharing-policy file: <config_dir>/sharing_policy.json, i.e.
    $FLOTILLA_CONFIG/sharing_policy.json or, by default,
    ~/.config/flotilla/sharing_policy.json (Linux),
    %LOCALAPPDATA%\\flotilla\\sharing_policy.json (Windows),
    ~/Library/Application Support/flotilla/sharing_policy.json (macOS).
    The app's Settings view writes it; the fleet agent (engine.fleet.policy.
    SharingPolicy.load) reads it and reloads it when it changes. Fields:
    enabled, idle_minutes, require_ac, max_ram_gb, devices, yield_on_return,
    max_cpu_percent_to_start."""
    from engine.fleet.policy import POLICY_FILE

    return config_dir() / POLICY_FILE


def load_sharing_policy() -> dict:
    """The policy as a plain dict (defaults for a missing or broken file)."""
    import dataclasses

    from engine.fleet.policy import SharingPolicy

    d = dataclasses.asdict(SharingPolicy.load(config_dir()))
    d["devices"] = list(d["devices"])
    return d


def save_sharing_policy(policy: dict) -> Path:
    """Validate and write the policy atomically; ValueError for bad values."""
    import dataclasses

    from engine.fleet.policy import SharingPolicy

    names = {f.name for f in dataclasses.fields(SharingPolicy)}
    kw = {k: (tuple(v) if k == "devices" else v) for k, v in policy.items() if k in names}
    SharingPolicy(**kw).save(config_dir())
    return sharing_policy_path()


# ----------------------------------------------------------------------- API server
def start_api_server(engine: Engine, port: int = 8000, host: str = "127.0.0.1") -> Any:
    """Serve `engine` on an OpenAI-compatible API; returns the started server
    (.url, .port, .stop()). Blocking until it listens; OSError if the port is taken."""
    from engine.serve.api import ApiServer, create_app

    return ApiServer(create_app(engine), host, port).start()


def _one_line(e: BaseException) -> str:
    return (" ".join(str(e).split()) or type(e).__name__)[:300]
