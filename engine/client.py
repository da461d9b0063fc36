"""The engine facade for the desktop app.

This is the only engine module, besides engine.protocol, that app/ may import
(import-linter enforces it). Everything the app needs from the engines goes
through a function here, so the engine packages can change shape without the
app noticing, and so one file shows the whole app <-> engine surface:

  engines   engine_kinds, open_engine, launch_pipeline, ring_snapshot, stage_pids,
            engine_load, SpecChoice, speculative_available, draft_models
  models    list_models, list_demo_models, model_profile, import_model_folder,
            download_model, convert_to_openvino
  planning  plan_model, local_peers, fleet_peers, plan_request,
            WEIGHT_CHOICES, plan_precision, auto_plan, evaluate_plan, validate_plan,
            move_boundary, exclude_peer, pin_device, balanced_plan
            (a Plan made here is what launch_pipeline / launch_fleet launch, as is)
  fleet     this_pc, FleetWatcher (mDNS + manual peers, live), pair_peer,
            pairing_code_for, fleet_launch_available, launch_fleet,
            peer_addresses, add_peer_address, remove_peer_address
  agent     AgentHandle: this PC's agent as its tray drives it (state, pairing
            requests accept/deny, revoke, pause, share now, policy)
  settings  config_dir, settings_dir, data_dir, sharing_policy_path, load/save_sharing_policy
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
from engine.core.interface import Engine, EngineError, EngineInfo

__all__ = [
    "AgentHandle", "AgentState", "DownloadPaused", "Engine", "EngineError", "EngineInfo", "EngineKind",
    "FleetChange", "FleetWatcher", "LaunchCancelled", "LaunchStep", "PairedController", "PairingRequest",
    "PeerCard", "RingSnapshot", "RingStage", "SpecChoice",
    "open_engine", "engine_kinds", "engine_load", "launch_pipeline", "launch_fleet", "ring_snapshot",
    "stage_pids", "speculative_available", "draft_models", "list_demo_models", "list_models",
    "model_profile", "import_model_folder", "download_model", "convert_to_openvino", "plan_model",
    "local_peers", "fleet_peers", "plan_request", "auto_plan", "balanced_plan", "evaluate_plan",
    "validate_plan", "plan_precision", "WEIGHT_CHOICES", "move_boundary", "exclude_peer", "pin_device", "this_pc", "controller_name", "pair_peer",
    "pairing_code_for", "fleet_launch_available", "peer_addresses", "add_peer_address",
    "remove_peer_address", "config_dir", "settings_dir", "data_dir", "sharing_policy_path", "load_sharing_policy",
    "save_sharing_policy", "start_api_server",
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
    "local": ("engine.local.paged", "Local dense"),
    "moe": ("engine.moe.engine", "Local MoE offload"),
    "sparse": ("engine.sparse.engine", "Local sparse"),
}


def engine_kinds() -> list[EngineKind]:
    """Every engine kind the UI offers, with whether it can open now. Blocking
    (imports each engine's module, which may pull in torch)."""
    from engine.local.factory import ENGINE_KINDS

    out = []
    for name, (module, label) in _KIND_MODULES.items():
        desc = ENGINE_KINDS[name][1] if name in ENGINE_KINDS else ""
        if name not in ENGINE_KINDS:
            out.append(EngineKind(name, label, desc, False, "not built yet (engine.local.factory "
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


@dataclass(frozen=True)
class SpecChoice:
    """Speculative decoding as the app offers it (engine/speculative): the
    engine's default for every request; a request can still say otherwise."""

    mode: str = "off"  # "off" | "draft" (a small draft model) | "lookup" (prompt n-grams, no model)
    k: int = 4  # drafted tokens per step (the start value when adaptive)
    adaptive: bool = True  # adapt K to the running acceptance rate
    draft_model: str | None = None  # draft model spec (demo-draft for demo); None = the target's known draft


SPEC_MODES = ("off", "draft", "lookup")
SPEC_MAX_K = 16


def speculative_available() -> tuple[bool, str]:
    """Speculative decoding (engine/speculative, mask-based rollback): can it be switched on?"""
    try:
        importlib.import_module("engine.speculative.config")
    except Exception as e:
        return False, f"speculative decoding does not import: {_one_line(e)}"
    return True, ""


def draft_models(spec: str) -> list[str]:
    """Draft model choices for a target, the known draft first (demo -> demo-draft)."""
    from engine.models.demo import demo_ids
    from engine.speculative.config import known_draft

    first = known_draft(spec)
    rest = [d for d in demo_ids() if d.endswith("draft") and d != first]
    return ([first] if first else []) + rest


def _spec_config(choice: SpecChoice | None) -> Any:
    if choice is None or choice.mode == "off":
        return None
    from engine.speculative.config import SpecConfig

    return SpecConfig(mode=choice.mode, k=choice.k, k_max=max(choice.k, 8), adaptive=choice.adaptive,
                      draft_model=choice.draft_model if choice.mode == "draft" else None)


def engine_load(engine: Engine | None) -> tuple[int, int] | None:
    """(running, queued) requests of an engine now, when it can say (engine.load());
    None otherwise. Cheap (a counter under a lock), but call it off the GUI thread."""
    load = getattr(engine, "load", None)
    if load is None:
        return None
    try:
        now = load()
        return int(now.running), int(now.queued)
    except Exception:
        return None


def open_engine(spec: str = "demo", device: str = "CPU", progress: Progress | None = None,
                kind: str = "local", cache_budget_bytes: int | None = None,
                context_length: int | None = None, streams: int | None = None,
                speculative: SpecChoice | None = None) -> Engine:
    """Open an engine of `kind` for `spec` (a demo id, a model folder or a hub id).

    Blocking and slow (it may build a demo model and compile it): call it off
    the GUI thread. `progress` is called from that same thread. `speculative`
    (local engine): the default speculation of its requests.
    """
    if kind == "local":
        from engine.models import resolve_model
        from engine.local.factory import open_whole_model  # lazy: pulls in torch/OpenVINO

        kw: dict[str, Any] = {}
        if context_length:
            kw["context_length"] = context_length
        if streams:
            kw["max_concurrent"] = streams
        spec_cfg = _spec_config(speculative)
        if spec_cfg is not None:
            kw["speculative"] = spec_cfg
        resolved = resolve_model(spec, progress)
        return open_whole_model(Path(resolved.path), resolved.model_id, progress, device=device, **kw)
    from engine.local.factory import EngineOptions, open_engine as factory_open

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


def launch_pipeline(spec: str, plan: Any, step: Callable[[LaunchStep], None] | None = None,
                    cancel: threading.Event | None = None, speculative: Any = None,
                    recover: bool = True) -> Engine:
    """Start `plan` (a Plan over local_peers(), as the plan editor shows it) as
    one stage process per stage on this PC (loopback) and wire it:
    engine.pipeline.runner.launch_pipeline with its per-stage progress and
    cancel hooks. Blocking.

    The plan's ranges, device, weight precision, context and streams are
    launched as they are: the runner checks that split against this PC's RAM
    now and refuses ("the plan cannot run on this PC: stage 1: ...", a
    PlanError before anything is exported) when it no longer fits; it never
    re-plans. Every stage runs on one device.
    Reports LaunchStep per stage (transfer = the shard is exported/copied
    into place, compile = the worker loads and compiles it, ready). Setting
    `cancel` stops every process and raises LaunchCancelled. `speculative`: a
    SpecChoice (or None = off); `recover`: re-plan onto a warm standby when a
    stage dies (recovery, not launch)."""
    from engine.pipeline.plan_weights import refuse
    from engine.pipeline.runner import FleetConfig
    from engine.pipeline.runner import LaunchCancelled as RunnerCancelled
    from engine.pipeline.runner import launch_pipeline as run

    report = step or (lambda _s: None)
    stages = list(plan.stages)
    devices = list(dict.fromkeys(s.device for s in stages))
    if len(devices) != 1:
        raise refuse(None, "mixed_devices", "the local runner runs every stage on one device: "
                                            f"the plan uses {', '.join(devices) or 'none'}")
    n = len(stages)
    cfg = FleetConfig(model=spec, stages=n, split=tuple((s.start, s.end) for s in stages), device=devices[0],
                      weights=plan.weight_precision, context_length=plan.context_length,
                      max_concurrent=plan.streams, recover=recover)

    def same_plan(launched: Any) -> None:  # the runner evaluated exactly this plan; say so if not
        got = [(s.start, s.end, s.device) for s in launched.stages]
        want = [(s.start, s.end, s.device) for s in stages]
        if (got != want or launched.weight_precision != plan.weight_precision
                or launched.context_length != plan.context_length):
            raise refuse(None, "plan_changed", f"the runner would launch {got} at {launched.weight_precision}, "
                                               f"not the plan {want} at {plan.weight_precision}")

    weights = {"transfer": (0.0, 0.4), "compile": (0.4, 0.6), "ready": (1.0, 0.0)}
    words = {"transfer": "shard in place", "compile": "worker compiling", "ready": "ready"}

    def on_stage(i: int, phase: str, fraction: float) -> None:
        base, span = weights.get(phase, (0.0, 0.0))
        message = words.get(phase, phase) if phase != "transfer" or fraction >= 1.0 else "exporting shard"
        report(LaunchStep(i, phase, base + span * fraction, message))

    for i in range(n):
        report(LaunchStep(i, "waiting", 0.0, "waiting"))
    try:
        engine = run(cfg, None, speculative=_spec_config(speculative), on_stage=on_stage, cancel=cancel,
                     on_plan=same_plan)
    except RunnerCancelled:
        raise LaunchCancelled("launch cancelled") from None
    engine.launched_at = time.monotonic()  # type: ignore[attr-defined]  # ring_snapshot reads it
    return engine


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
    # Each stage is sized as a PC of its share of the RAM (the OS reserve scales with it).
    return [PeerProfile(f"local-{i}", f"This PC #{i + 1}" if count > 1 else "This PC", devices, share,
                        card.ram_total // max(1, count)) for i in range(count)]


def fleet_peers(cards: Sequence["PeerCard"]) -> list[Any]:
    """PeerProfiles for the planner from reachable fleet cards."""
    from engine.pipeline.plan import DEVICE_KINDS, DeviceProfile, PeerProfile

    out = []
    for c in cards:
        if not c.reachable:
            continue
        devs = tuple(DeviceProfile(d.split(".")[0], d) for d in c.devices if d.split(".")[0] in DEVICE_KINDS)
        out.append(PeerProfile(c.peer_id, c.name, devs or (DeviceProfile("CPU", "CPU"),), c.ram_free, c.ram_total))
    return out


# Weight precisions a plan may use; "auto" = the most precise at which the plan fits, starting at the
# checkpoint's own dtype (the planner resolves it: a Plan always holds one concrete precision).
WEIGHT_CHOICES = ("auto", "f32", "bf16", "fp16", "int8", "int4")


def plan_request(context_length: int | None = None, streams: int = 1, weight_precision: str = "auto") -> Any:
    """What to plan for. context_length None: the planner's default (engine.models.profile.
    DEFAULT_CONTEXT, at most the model's). weight_precision: one of WEIGHT_CHOICES ("auto" = the most precise
    at which the plan fits, from the model's own dtype, PlanModel.checkpoint_precision,
    down). Every planning function below returns a Plan at one concrete precision
    (plan_precision(plan)). PlanError (code bad_weights) for an unknown precision."""
    from engine.pipeline.plan import PlanRequest
    from engine.pipeline.plan_weights import check_choice

    return PlanRequest(context_length=context_length, streams=streams, weight_precision=check_choice(weight_precision))


def plan_precision(plan: Any) -> str:
    """The weight precision a plan's shards are exported and run at ("int4", "f32", ...)."""
    return plan.weight_precision


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
    """Predictions for these stages ((peer_id, device, start, end) or a Plan) at the asked
    precision ("auto": the most precise at which every stage fits); a stage that
    overflows is marked fits=False, a malformed one raises PlanError."""
    from engine.pipeline.plan_validate import evaluate_plan as evaluate

    return evaluate(stages, model, peers, request)


def validate_plan(stages: Any, model: Any, peers: Sequence[Any], request: Any) -> list[Any]:
    """Every issue of a plan ([] = it can launch). A Plan is checked at its own precision."""
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
    handle: Any = field(default=None, compare=False, repr=False)  # engine.fleet Peer, for pairing/launch


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


def _controller_keys() -> Any:
    from engine.transport.security import KeyPair

    return KeyPair.load_or_create(config_dir())  # the same node key launch.controller_keys() uses


def pairing_code_for(card: PeerCard) -> str:
    """The 6 digits this app shows for pairing with card's agent (computed here,
    from both public keys, never taken from the agent). Reads our key: blocking."""
    from engine.transport.security import pairing_code

    return pairing_code(card.public_key, _controller_keys().public)


def _card(peer: Any, paired: bool | None, sharing_now: bool | None, why: str) -> PeerCard:
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


async def _probe(keys: Any, peer: Any, timeout: float = 3.0) -> tuple[bool | None, bool | None, str]:
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
        return None, None, f"its control port does not answer ({_one_line(e)})"
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
        self._loop: Any = None
        self._manual: Any = None
        self._queue: Any = None
        self._probed: dict[str, tuple[float, tuple]] = {}  # node_id -> (when, probe result)
        self._keys: Any = None

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
                yield FleetChange("error", message=f"cannot start discovery: {_one_line(e)}")
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
    def _on_peer(self, kind: str, peer: Any) -> None:
        if kind == "removed":
            self._probed.pop(peer.node_id, None)
            self._queue.put(FleetChange("removed", _card(peer, None, None, "")))
            return
        import asyncio

        asyncio.get_running_loop().create_task(self._report(kind, peer))

    async def _report(self, kind: str, peer: Any, force: bool = False) -> None:
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
        mod = importlib.import_module("engine.fleet.launch")
    except Exception as e:
        return False, f"the fleet launcher (engine/fleet/launch.py) is not available: {_one_line(e)}"
    missing = [n for n in ("FleetSession", "LaunchConfig") if not hasattr(mod, n)]
    if missing:
        return False, f"the fleet launcher lacks {', '.join(missing)}"
    return True, ""


def launch_fleet(spec: str, plan: Any, cards: Sequence[PeerCard],
                 step: Callable[[LaunchStep], None] | None = None,
                 cancel: threading.Event | None = None) -> Engine:
    """Launch `plan` (a Plan over fleet_peers(), as the plan editor shows it:
    per-stage node id and device, ranges, weight precision, context, streams)
    on fleet agents through engine/fleet/launch.py, as is: the launcher checks
    it against the agents' fresh status and refuses (PlanError naming the
    stage, before any shard is exported or sent) when it no longer fits; it
    never re-plans. Then the shards are sent (resumable), workers loaded, a
    CURVE PipelineEngine wired. Blocking; per-stage LaunchStep like
    launch_pipeline. Setting `cancel` stops at the next step (everything
    started is unloaded) with LaunchCancelled."""
    from engine.fleet import launch as fl

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

    def on_stage(p: "fl.StageProgress") -> None:
        if not 0 <= p.stage < n:
            return
        if p.phase == "start":
            report(LaunchStep(p.stage, "compile", 0.5, p.message))
        else:  # export/pack the shard, then send it (or the peer has it): the first 40 % of a stage's bar
            done = {"send": p.fraction, "have": 1.0}.get(p.phase, 0.0)
            report(LaunchStep(p.stage, "transfer", 0.4 * done, p.message))

    cfg = fl.LaunchConfig(model=spec, stages=n, weights=plan.weight_precision, context_length=plan.context_length,
                          max_concurrent=plan.streams)
    session = fl.FleetSession(_controller_keys(), peers, cfg, progress, plan=plan, on_stage=on_stage)
    try:
        engine = session.launch()
    except LaunchCancelled:
        raise
    except Exception as e:
        from engine.pipeline.plan import PlanError

        if cancel.is_set():
            raise LaunchCancelled("launch cancelled") from None
        if isinstance(e, (EngineError, PlanError)):
            raise
        raise EngineError(_one_line(e)) from None
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


# ----------------------------------------------------------------------- agent (the tray)
@dataclass(frozen=True)
class PairingRequest:
    """A controller asking to use this PC, waiting for its owner's yes."""

    name: str  # what the controller calls itself
    fingerprint: str  # of its key (16 hex)
    code: str  # the 6 digits its screen shows; accept only if they match
    age_s: float  # seconds since it asked (requests expire after 10 minutes)


@dataclass(frozen=True)
class PairedController:
    name: str
    fingerprint: str


@dataclass(frozen=True)
class AgentState:
    """What the tray shows about this PC's agent."""

    state: str  # "idle" | "sharing" | "busy" | "paused" | "stopped"
    summary: str  # one line for the tooltip and the menu's header
    running: bool  # the agent answered on its info port
    workers: int  # shard workers running for controllers (-1 = unknown)
    share_now: bool  # "Share now" is on (the idle wait is skipped)
    paused: bool  # the owner switched sharing off
    pending: tuple[PairingRequest, ...]  # pairing requests waiting, oldest first
    paired: tuple[PairedController, ...]  # controllers allowed to use this PC


TRAY_FILE = "tray.json"  # the tray's own memory (the idle wait before "Share now")


class AgentHandle:
    """This PC's agent as its tray drives it: the same files and ports
    `flotilla agent pair/policy` use (the pairing book, sharing_policy.json),
    plus the agent's plaintext info port for its live state. No pairing with
    itself: the tray is the owner's UI, with the owner's file access.

    Blocking methods: call them on the app's Runner."""

    def __init__(self, config: Path | None = None, *, info_port: int | None = None,
                 host: str = "127.0.0.1", pid: int | None = None) -> None:
        from engine.fleet.discovery import DEFAULT_BASE_PORT, INFO_OFFSET

        self.config = Path(config) if config else config_dir()
        self.info_port = info_port or DEFAULT_BASE_PORT + INFO_OFFSET
        self.host = host
        self.pid = pid  # the agent's process: its children are the shard workers
        self.proc: Any = None  # set by spawn(): the agent child process
        self.lines: Any = None  # its last stderr lines (spawn)

    @classmethod
    def spawn(cls, argv: Sequence[str] = (), timeout: float = 60.0,
              config: Path | None = None) -> "AgentHandle":
        """Start `flotilla agent --headless ARGV` as a child process and wait
        until it is up (the tray of `flotilla agent` runs the agent this way, so
        the agent never shares a process with Qt). EngineError if it does not start."""
        import collections
        import subprocess
        import sys

        args = [a for a in argv if a not in ("--headless", "-v", "--verbose", "--stdin-lifeline", "--announce")]
        env = dict(os.environ)
        if config is not None:  # another agent's config dir (demos, screenshots)
            env["FLOTILLA_CONFIG"] = str(config)
        # stdin is the agent's lifeline: stop() closes it and the agent stops cleanly (the same on
        # every OS: on Windows terminate() is TerminateProcess, which runs no cleanup); it also
        # ends when this process dies, so the agent never outlives its tray.
        from engine.platform import process

        # hidden: no console window on Windows; its own group, so a Ctrl-C meant for the tray's
        # terminal does not skip the agent's cleanup (the lifeline stops it in order instead).
        # --announce: once serving, the agent writes its ports as one AgentUp line on stdout
        proc = process.spawn([sys.executable, "-m", "engine.cli.agent_cmd", "--headless", "-v",
                              "--stdin-lifeline", "--announce", *args], hidden=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
        lines: collections.deque[str] = collections.deque(maxlen=200)
        up = threading.Event()
        announced: list[Any] = []  # the AgentUp, once read

        def log_pump() -> None:  # its log, for the error below and the tray's view; read to the end
            for line in proc.stderr:
                lines.append(line.rstrip())
            up.set()  # the agent ended: stop waiting

        def announce_pump() -> None:  # its stdout, read to the end so it never fills
            from engine.protocol.control import AgentUp
            from engine.protocol.errors import ProtocolError

            for line in proc.stdout:
                if announced:
                    continue
                try:
                    msg = AgentUp.from_line(line)
                except ProtocolError as e:
                    lines.append(f"unreadable agent_up line: {e}")
                    msg = None
                if msg is not None:
                    announced.append(msg)
                    up.set()
            up.set()

        threading.Thread(target=log_pump, name="flotilla-agent-log", daemon=True).start()
        threading.Thread(target=announce_pump, name="flotilla-agent-announce", daemon=True).start()
        if not up.wait(timeout) or not announced:
            from engine.platform.process import kill_tree

            kill_tree(proc)  # and whatever it started
            proc.wait(5)
            raise EngineError("the agent did not start: " + (" | ".join(list(lines)[-5:]) or "no output"))
        handle = cls(config, info_port=announced[0].info_port, pid=proc.pid)
        handle.proc, handle.lines = proc, lines
        return handle

    # -- reading ------------------------------------------------------------------
    def state(self, timeout: float = 1.0) -> AgentState:
        from engine.transport.security import PairingBook, fingerprint

        info, running = self._info(timeout), False
        running = info is not None
        policy = load_sharing_policy(self.config)
        tray = self._tray()
        book = PairingBook(self.config)
        allowed = book.allowed.entries()
        dismissed = {**tray.get("dismissed", {}), **allowed}  # accepted ones stay in the agent's file
        now = time.time()
        pending = tuple(sorted(
            (PairingRequest(str(v.get("name", "controller")), fingerprint(k), str(v.get("code", "")),
                            max(0.0, now - float(v.get("time", now))))
             for k, v in book.pending().items() if k not in dismissed),
            key=lambda r: -r.age_s))
        paired = tuple(PairedController(str(v.get("name", "controller")), fingerprint(k))
                       for k, v in allowed.items())
        workers = self._workers()
        paused = not policy.get("enabled", True)
        share_now = bool(tray.get("share_now")) and not paused
        on_battery = info is not None and info.on_ac is False and policy.get("require_ac", True)
        if not running:
            state, summary = "stopped", "The agent is not running"
        elif paused:
            state, summary = "paused", "Paused: this PC is not shared"
        elif workers > 0:
            state, summary = "busy", f"Busy: {workers} shard worker{'s' if workers != 1 else ''} running"
        elif on_battery:
            state, summary = "idle", "Not sharing: on battery"
        elif info.idle:
            state, summary = "sharing", ("Sharing now (Share now is on)" if share_now
                                         else "Sharing: you are away, the fleet may use this PC")
        else:
            mins = float(policy.get("idle_minutes", 5))
            state, summary = "idle", f"Not sharing: you are using this PC (shares after {mins:g} min idle)"
        if pending:
            summary += f" · {len(pending)} pairing request{'s' if len(pending) != 1 else ''}"
        return AgentState(state, summary, running, workers, share_now, paused, pending, paired)

    def _info(self, timeout: float) -> Any:
        import zmq.asyncio

        from engine import aio
        from engine.fleet.discovery import async_query_info

        async def ask() -> Any:
            ctx = zmq.asyncio.Context()
            try:
                return await async_query_info(ctx, self.host, self.info_port, timeout=timeout)
            finally:
                ctx.term()

        try:
            return aio.run(ask())
        except Exception:
            return None

    def _workers(self) -> int:
        if self.pid is None:
            return -1
        try:
            import psutil

            return sum(1 for c in psutil.Process(self.pid).children() if c.status() != psutil.STATUS_ZOMBIE)
        except Exception:
            return 0

    def _tray(self) -> dict:
        from engine.fleet.paths import read_json

        data = read_json(self.config / TRAY_FILE, {})
        return data if isinstance(data, dict) else {}

    def _save_tray(self, data: dict) -> None:
        from engine.fleet.paths import write_json

        write_json(self.config / TRAY_FILE, data)

    # -- pairing ------------------------------------------------------------------
    def accept(self, code: str) -> str:
        """Allow the pending controller showing `code`; its name. EngineError if none does."""
        from engine.transport.security import PairingBook

        try:
            return PairingBook(self.config).accept(code)
        except LookupError as e:
            raise EngineError(str(e)) from None

    def deny(self, code: str) -> None:
        """Refuse a pending request: it is not paired (nothing to undo) and the
        tray stops showing it; it expires on the agent after 10 minutes."""
        from engine.transport.security import PENDING_TTL_S, PairingBook

        tray = self._tray()
        now = time.time()
        dismissed = {k: t for k, t in tray.get("dismissed", {}).items() if now - t < PENDING_TTL_S}
        for key, entry in PairingBook(self.config).pending().items():
            if entry.get("code") == code:
                dismissed[key] = now
        tray["dismissed"] = dismissed
        self._save_tray(tray)

    def revoke(self, fingerprint_or_name: str) -> list[str]:
        """Forget a paired controller (new and open connections are refused from now on)."""
        from engine.transport.security import PairingBook

        return PairingBook(self.config).allowed.revoke(fingerprint_or_name)

    # -- sharing ------------------------------------------------------------------
    def pause(self, paused: bool = True) -> None:
        """Switch sharing off (running shard workers stop within 2 s) or back on."""
        policy = load_sharing_policy(self.config)
        policy["enabled"] = not paused
        save_sharing_policy(policy, self.config)

    def share_now(self, on: bool = True) -> None:
        """Lend the PC now, without waiting for the idle time (on), or go back
        to the policy's idle wait (off). Also un-pauses."""
        policy = load_sharing_policy(self.config)
        tray = self._tray()
        if on:
            if not tray.get("share_now"):
                tray["idle_minutes_before"] = policy.get("idle_minutes", 5.0)
            policy.update(enabled=True, idle_minutes=0.0)
            tray["share_now"] = True
        else:
            policy["idle_minutes"] = float(tray.pop("idle_minutes_before", 5.0) or 0.0) \
                if tray.get("share_now") else policy.get("idle_minutes", 5.0)
            tray["share_now"] = False
        save_sharing_policy(policy, self.config)
        self._save_tray(tray)

    def load_policy(self) -> dict:
        return load_sharing_policy(self.config)

    def save_policy(self, policy: dict) -> Path:
        return save_sharing_policy(policy, self.config)

    # -- the process ----------------------------------------------------------------
    def stop(self, timeout: float = 10.0) -> None:
        """Stop the agent this handle started and wait for it: it is asked first -- its stdin
        closes, and the agent stops its shard workers, says goodbye on mDNS and exits -- and
        only killed, with its workers, when it is still running `timeout` s later."""
        from engine.platform.process import stop as stop_process

        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        stop_process(proc, timeout, ask=lambda: _close_lifeline(proc))

    def wait(self) -> int:
        return int(self.proc.wait()) if self.proc is not None else 0


def _close_lifeline(proc: Any) -> None:
    """Close the agent's stdin (AgentHandle.spawn gave it --stdin-lifeline): its request to stop.
    An agent started otherwise (no pipe) gets the OS's graceful stop instead."""
    if proc.stdin is None:
        from engine.platform.process import interrupt

        interrupt(proc)
        return
    try:
        proc.stdin.close()
    except OSError:
        pass


# ----------------------------------------------------------------------- settings
def config_dir() -> Path:
    """$FLOTILLA_CONFIG, else the platform's per-user config folder (created)."""
    from engine.fleet.paths import config_dir as cfg

    return cfg()


def settings_dir() -> Path:
    """The app's preferences folder (app_settings.json): engine.paths.settings_dir()."""
    from engine.paths import settings_dir as settings

    return settings()


def data_dir() -> Path:
    """Where the app keeps conversations: engine.paths.history_dir() ($FLOTILLA_DATA, else
    the platform's per-user history folder), created if missing."""
    from engine.paths import history_dir

    return history_dir()


def sharing_policy_path() -> Path:
    """THE sharing-policy file: <keys folder>/sharing_policy.json (engine/paths.py), i.e.
    $FLOTILLA_CONFIG/sharing_policy.json or, by default,
    ~/.config/flotilla/keys/sharing_policy.json (Linux),
    %LOCALAPPDATA%\\flotilla\\keys\\sharing_policy.json (Windows),
    ~/Library/Application Support/flotilla/keys/sharing_policy.json (macOS).
    The app's Settings view writes it; the fleet agent (engine.fleet.policy.
    SharingPolicy.load) reads it and reloads it when it changes. Fields:
    enabled, idle_minutes, require_ac, max_ram_gb, devices, yield_on_return,
    max_cpu_percent_to_start."""
    from engine.fleet.policy import POLICY_FILE

    return config_dir() / POLICY_FILE


def load_sharing_policy(config: Path | None = None) -> dict:
    """The policy as a plain dict (defaults for a missing or broken file)."""
    import dataclasses

    from engine.fleet.policy import SharingPolicy

    d = dataclasses.asdict(SharingPolicy.load(config or config_dir()))
    d["devices"] = list(d["devices"])
    return d


def save_sharing_policy(policy: dict, config: Path | None = None) -> Path:
    """Validate and write the policy atomically; ValueError for bad values."""
    import dataclasses

    from engine.fleet.policy import POLICY_FILE, SharingPolicy

    names = {f.name for f in dataclasses.fields(SharingPolicy)}
    kw = {k: (tuple(v) if k == "devices" else v) for k, v in policy.items() if k in names}
    folder = config or config_dir()
    SharingPolicy(**kw).save(folder)
    return folder / POLICY_FILE


# ----------------------------------------------------------------------- API server
def start_api_server(engine: Engine, port: int = 8000, host: str = "127.0.0.1", api_key: str | None = None,
                     no_auth: bool = False) -> Any:
    """Serve `engine` on an OpenAI-compatible API; returns the started server
    (.url, .port, .stop(), .access: the key it requires and the notice to show).
    Beyond loopback a key is required (engine.serve.auth). Blocking until it
    listens; OSError if the port is taken."""
    from engine.serve.api import ApiServer, create_app
    from engine.serve.auth import decide

    access = decide(host, port, api_key, no_auth)
    server = ApiServer(create_app(engine, api_key=access.api_key), host, port)
    server.access = access
    return server.start()


def _one_line(e: BaseException) -> str:
    return (" ".join(str(e).split()) or type(e).__name__)[:300]
