"""The local fleet runner: a whole pipeline on this PC, one process per stage.

    engine = launch_pipeline(FleetConfig(model="demo", stages=3), progress)
    ...                      # any Engine use: submit / stream / cancel
    engine.close()           # also stops every stage process

Steps, each of which can fail with a clear message before the next starts:
1. plan: an even split by layers (or an explicit one) over equal synthetic
   local peers that share this PC's RAM, checked by the planner
   (validate_plan): a plan that does not fit raises PlanError and nothing is
   launched. (auto_plan would put a small model on one peer: with equal peers
   the fewest-peers plan wins, so the user's stage count is honoured instead.)
   Weights "auto" become the most precise precision at which that split fits
   (the planner resolves it); on_plan shows the plan before step 2.
2. export: every stage's shard from the cache at the plan's precision,
   exported on a miss (progress).
3. launch: one `python -m engine.shards.worker` per stage on loopback, each
   binding a free port it reports on stdout, in its own session (Ctrl-C in
   the terminal reaches only us), watching our pid so it exits if we die.
4. wire: PipelineEngine tells each stage its next hop and waits until all
   answer (shards compiled). Every data socket is CURVE-encrypted with
   throw-away keys (engine/transport/curve_data.py), as on a real fleet, unless
   FleetConfig.curve is False (`flotilla pipeline --plaintext`).
stop() (also on close, at exit and on any launch error) asks each stage to stop
(engine/platform/process.py: SIGTERM to its group, CTRL_BREAK on Windows), then
kills what is left after a grace period, children included: no orphans.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from engine.platform import process
from engine.pipeline.coordinator import PipelineConfig, PipelineEngine
from engine.pipeline.prompt_cache import planned_kv_bytes, stage_kv_precision
from engine.pipeline.stage_link import StageLink
from engine.shards import worker_process
from engine.shards.worker_process import WorkerStartError
from engine.core.interface import EngineError
from engine.planner import weights as plan_weights
from engine.planner.issues import PlanError
from engine.planner.model import PlanModel
from engine.planner.peers import DEVICE_KINDS, DeviceProfile, PeerProfile
from engine.planner.request import PlanRequest
from engine.planner.stages import Plan

log = logging.getLogger(__name__)

Progress = Callable[[str, float], None]
# on_stage(stage index, phase, fraction of that phase): per-stage launch progress
# for UIs. Phases in order: "transfer" (the shard is exported/copied into
# place), "compile" (the worker runs and loads/compiles it), "ready".
StageProgress = Callable[[int, str, float], None]
STOP_GRACE_S = 2.0  # graceful stop -> kill


@dataclass(frozen=True)
class FleetConfig:
    model: str = "demo"  # model spec: demo id, HF folder or hub id
    stages: int = 2  # stage processes when no split is given (even split by layers)
    split: tuple[tuple[int, int], ...] | None = None  # explicit [start, end) ranges, in ring order
    exact: bool = False  # f32 inference + f32 KV cache on every stage (bit-comparable with torch)
    device: str = "CPU"  # OpenVINO device of every stage
    # Shard weight precision: "auto" = the most precise at which the plan fits, from the checkpoint's own
    # dtype down (the planner's choose_precision), or one of "f32", "bf16", "fp16", "int8", "int4".
    weights: str = "auto"
    threads: int | None = None  # OpenVINO inference threads per stage; None = plugin default
    ram_budget_bytes: int | None = None  # RAM all stages may use together; None = available RAM
    context_length: int | None = None  # tokens per stream (KV sizing, the engine's cap); None = default_context
    max_concurrent: int = 8  # streams in the ring at once (KV reserved for each on every stage)
    prefill_chunk: int = 512  # prompt tokens per step
    # follow-ups reuse whole prefill chunks only (PipelineConfig), and the stages keep a 16-bit KV
    # cache (EXACT_CACHE_KV), whose read-back is lossless, instead of the plugin's u8 default
    prompt_cache_exact: bool = False
    host: str = "127.0.0.1"  # where workers bind; loopback keeps the data plane private
    ready_timeout_s: float = 180.0  # every stage must be loaded and wired within this
    log_dir: Path | None = None  # worker logs; None = a temporary folder
    recover: bool = True  # a lost stage is restarted and every stream replayed (engine/pipeline/recovery.py)
    spares: int = 1  # warm standby processes that take over a lost stage in ~1 s (engine/pipeline/standby.py)
    curve: bool = True  # CURVE-encrypt every data socket (throw-away keys); False = plaintext, loopback only


def parse_split(text: str) -> tuple[tuple[int, int], ...]:
    """'0:3,3:6,6:8' -> ((0, 3), (3, 6), (6, 8))."""
    out = []
    for part in text.replace(" ", "").split(","):
        try:
            a, b = part.split(":")
            out.append((int(a), int(b)))
        except ValueError:
            raise PlanError(f"cannot read the split {text!r}: write ranges like 0:3,3:6,6:8") from None
    return tuple(out)


def even_split(total: int, stages: int) -> tuple[tuple[int, int], ...]:
    """Contiguous ranges whose sizes differ by at most one (earlier stages take the rest)."""
    if not 1 <= stages <= total:
        raise PlanError(f"cannot split {total} layers into {stages} stages: use 1 to {total} stages")
    base, extra = divmod(total, stages)
    ranges, start = [], 0
    for i in range(stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return tuple(ranges)


def available_ram() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        return 8 * 1024**3


def plan_local(model: PlanModel, cfg: FleetConfig, context_length: int) -> Plan:
    """The checked plan of cfg on this PC, its weight precision resolved by the planner
    (cfg.weights "auto": the most precise that fits); PlanError (a user-facing reason,
    each stage named) if it cannot run."""
    from engine.planner.validate import evaluate_plan

    ranges = cfg.split or even_split(model.num_layers, cfg.stages)
    budget = cfg.ram_budget_bytes if cfg.ram_budget_bytes is not None else available_ram()
    n = len(ranges)
    kind = cfg.device.split(".")[0].upper()
    device = DeviceProfile(kind if kind in DEVICE_KINDS else "CPU", cfg.device)
    peers = [PeerProfile(f"local-{i}", f"this PC #{i + 1}", (device,), budget // n) for i in range(n)]
    kv_bytes = planned_kv_bytes(stage_kv_precision(cfg.prompt_cache_exact, cfg.exact))  # as the workers keep it
    request = PlanRequest(context_length=context_length, streams=cfg.max_concurrent, exact=cfg.exact,
                          kv_dtype_bytes=kv_bytes, weight_precision=plan_weights.check_choice(cfg.weights))
    specs = [(p.peer_id, cfg.device, s, e) for p, (s, e) in zip(peers, ranges)]
    plan = evaluate_plan(specs, model, peers, request)
    plan_weights.check_plan(plan, model, peers, plan_weights.request_of(plan, kv_dtype_bytes=kv_bytes),
                            "the plan cannot run on this PC", asked=cfg.weights)
    return plan


class LocalFleet:
    """The stage processes of one pipeline on this PC."""

    def __init__(self, cfg: FleetConfig, progress: Progress | None = None) -> None:
        from engine.models import profile_model, resolve_model
        from engine.models.profile import engine_context

        self.cfg = cfg
        self.progress = progress or (lambda _m, _f: None)
        self.resolved = resolve_model(cfg.model, progress)
        self.model_path = Path(self.resolved.path)
        plan_weights.refuse_unsupported(self.model_path)
        self.profile = profile_model(self.resolved)
        # None: what a chat user picks (DEFAULT_CONTEXT, at most the model's), not a 128k maximum.
        self.context_length = engine_context(self.model_path, cfg.context_length)
        model = PlanModel.from_profile(self.profile)
        self.checkpoint = model.checkpoint_precision  # the model's own dtype: where weights "auto" starts
        self.plan = plan_local(model, cfg, self.context_length)
        self.procs: list[subprocess.Popen] = []
        self.links: list[StageLink] = []
        # None until launch() has a worker log to write: a fleet that never launches (a refused
        # export, a cancel) leaves no empty folder behind
        self.log_dir: Path | None = Path(cfg.log_dir) if cfg.log_dir else None
        self._own_log_dir = not cfg.log_dir  # a temporary folder: removed at stop() unless a stage died
        self.ring_keys: Any = None  # engine.transport.curve_data.LocalRingKeys when cfg.curve
        self.on_stage: StageProgress = lambda _i, _phase, _f: None  # launch_pipeline(on_stage=...)
        self._stopped = False
        self._lock = threading.Lock()  # stop() may run on another thread (a cancel) while launch() starts

    # -- export ------------------------------------------------------------------
    def export(self) -> list[Any]:
        """ShardInfo of every stage at the plan's weight precision, exporting missing ones."""
        import openvino as ov

        from engine.models.fingerprint import model_fingerprint
        from engine.shards.export import MANIFEST, ensure_shard, shard_cache_key, shard_cache_root

        fp = model_fingerprint(self.model_path)
        total = self.profile.num_layers
        precision = plan_weights.plan_precision(self.plan)  # the plan's, never re-chosen here
        infos = []
        stages = self.plan.stages
        for i, st in enumerate(stages):
            key = shard_cache_key(fp, st.start, st.end, precision, ov.get_version())
            cached = (shard_cache_root() / key / MANIFEST).exists()
            self.progress(f"{'shard' if cached else 'exporting shard'} {i} (layers {st.start}–{st.end}, "
                          f"{precision})", i / len(stages))
            self.on_stage(i, "transfer", 0.0)
            # One range at a time: the exporter reads only that range's weights.
            infos.append(ensure_shard(self.model_path, st.start, st.end, num_layers_total=total,
                                      precision=precision))
            self.on_stage(i, "transfer", 1.0)
        self.progress(f"{len(stages)} shards ready", 1.0)
        return infos

    # -- processes ---------------------------------------------------------------
    def launch(self, infos: list[Any]) -> list[StageLink]:
        """Start one worker per shard; returns their links once each reported its address."""
        from engine.models.demo import cache_root

        atexit.register(self.stop)
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="flotilla-pipeline-"))
        blobs = cache_root() / "ov-blobs"
        if self.cfg.curve:
            from engine.transport.curve_data import LocalRingKeys

            self.ring_keys = LocalRingKeys(len(infos))
        for i, info in enumerate(infos):
            cmd = worker_process.worker_command(
                info.path, f"tcp://{self.cfg.host}:*", f"stage {i}", self.cfg.device, blobs, exact=self.cfg.exact,
                kv_precision=stage_kv_precision(self.cfg.prompt_cache_exact, self.cfg.exact), threads=self.cfg.threads,
                curve=self.ring_keys.curve_files[i] if self.ring_keys is not None else None)
            log_path = self.log_dir / f"stage-{i}.log"
            # Own process group: a terminal Ctrl-C reaches only us; we stop them.
            proc = worker_process.spawn(cmd, log_path)
            with self._lock:
                self.procs.append(proc)
                stopped = self._stopped
            if stopped:  # stop() ran meanwhile (a cancelled launch): this one must not outlive it
                process.kill_tree(proc)
                proc.wait()
                raise PipelineLaunchError("the launch was stopped")
            st = self.plan.stages[i]
            self.links.append(StageLink(i, st.start, st.end, "", proc=proc, log_path=log_path,
                                        server_key=self.ring_keys.public_keys[i] if self.ring_keys else ""))
        for link in self.links:
            link.endpoint = self._read_bound(link)
            self.on_stage(link.index, "compile", 0.0)
        return self.links

    def _read_bound(self, link: StageLink) -> str:
        """The endpoint the worker printed as its first stdout line."""
        try:
            return worker_process.read_bound(link.proc, link.label, link.log_path)
        except WorkerStartError as e:
            raise PipelineLaunchError(str(e)) from None

    def stop(self) -> None:
        """Ask every stage to stop, then kill what is left after STOP_GRACE_S. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            procs = list(self.procs)
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass
        # A stage that ended on its own with an error: its log is what an error message names.
        died = any(p.poll() not in (None, 0) for p in procs)
        process.stop_all(procs, STOP_GRACE_S)
        if self.ring_keys is not None:
            self.ring_keys.cleanup()
        if self._own_log_dir and self.log_dir is not None and not died:
            shutil.rmtree(self.log_dir, ignore_errors=True)


class PipelineLaunchError(RuntimeError):
    """A stage process did not start."""


class LaunchCancelled(EngineError):
    """launch_pipeline(cancel=...) was set: every process it started was stopped."""


def _launch_cancelled() -> LaunchCancelled:
    return LaunchCancelled("launch cancelled")


class _CancelWatch:
    """Stops the fleet's processes as soon as `cancel` is set, so a launch blocked
    in a step (a worker starting, PipelineEngine waiting for every stage) fails
    at once instead of at its timeout."""

    def __init__(self, cancel: threading.Event, fleet: LocalFleet) -> None:
        self.cancel, self.fleet, self.over = cancel, fleet, threading.Event()
        threading.Thread(target=self._run, name="flotilla-launch-cancel", daemon=True).start()

    def _run(self) -> None:
        while not self.over.is_set():
            if self.cancel.wait(0.1):
                if not self.over.is_set():
                    self.fleet.stop()
                return


def launch_pipeline(cfg: FleetConfig, progress: Progress | None = None,
                    engine_config: PipelineConfig | None = None, speculative: Any = None, *,
                    on_stage: StageProgress | None = None,
                    cancel: threading.Event | None = None,
                    on_plan: Callable[[Plan], None] | None = None) -> PipelineEngine:
    """Plan, export, start and wire a local pipeline; engine.close() stops it.

    on_plan(plan) sees the checked plan (its weight precision resolved) before
    anything is exported: what a terminal shows the user first.
    on_stage(i, phase, fraction) reports each stage's progress (transfer,
    compile, ready); setting `cancel` stops every process started so far and
    raises LaunchCancelled (an EngineError: "launch cancelled").
    Raises PlanError before anything launches when the plan cannot run, and
    EngineError (after stopping whatever started) when a stage fails to come up."""
    cancel = cancel or threading.Event()
    fleet = LocalFleet(cfg, progress)  # plans: may raise PlanError, nothing started yet
    if on_plan is not None:
        on_plan(fleet.plan)

    def stage(i: int, phase: str, fraction: float) -> None:
        if cancel.is_set():
            raise _launch_cancelled()
        if on_stage is not None:
            on_stage(i, phase, fraction)

    fleet.on_stage = stage
    watch = _CancelWatch(cancel, fleet)
    try:
        infos = fleet.export()
        if progress:
            progress(f"starting {len(infos)} stage processes", 0.0)
        links = fleet.launch(infos)
        pcfg = engine_config or PipelineConfig(
            max_concurrent=cfg.max_concurrent, prefill_chunk=cfg.prefill_chunk,
            prompt_cache_exact=cfg.prompt_cache_exact, context_length=fleet.context_length,
            return_bind=f"tcp://{cfg.host}:*",
            ready_timeout_s=cfg.ready_timeout_s, device=cfg.device)
        if fleet.ring_keys is not None and pcfg.curve is None:
            pcfg = dataclasses.replace(pcfg, curve=fleet.ring_keys.coordinator)
        engine = PipelineEngine(links, fleet.model_path, fleet.resolved.model_id, pcfg, on_close=fleet.stop,
                                speculative=speculative)  # a SpecConfig (engine/speculative)
        watch.over.set()
        if cancel.is_set():
            engine.close()
            raise _launch_cancelled()
        if on_stage is not None:
            for i in range(len(links)):
                on_stage(i, "ready", 1.0)
        if progress:
            progress(f"{len(infos)} stages ready", 1.0)
    except PipelineLaunchError as e:
        fleet.stop()
        raise (_launch_cancelled() if cancel.is_set() else EngineError(str(e))) from None
    except BaseException as e:
        fleet.stop()
        if cancel.is_set() and not isinstance(e, PlanError):
            raise _launch_cancelled() from None
        raise
    finally:
        watch.over.set()
    engine.fleet = fleet  # type: ignore[attr-defined]  # for status displays and tests
    if cfg.recover:
        from engine.pipeline.standby import LocalRingProvider

        fleet.infos = infos  # type: ignore[attr-defined]
        engine.enable_recovery(LocalRingProvider(fleet, spares=cfg.spares))
    return engine


def open_pipeline_engine(spec: str, options: Any, progress: Progress | None = None) -> PipelineEngine:
    """engine.local.factory opener: options.extra may carry stages, split, threads, max_concurrent,
    context_length, prefill_chunk, prompt_cache_exact, speculative (a SpecConfig)."""
    extra = dict(getattr(options, "extra", {}) or {})
    split = extra.get("split")
    if isinstance(split, str):
        split = parse_split(split)
    cfg = FleetConfig(model=spec, stages=int(extra.get("stages", 2)),
                      split=tuple(tuple(r) for r in split) if split else None,
                      exact=getattr(options, "precision", "default") == "f32",
                      device=getattr(options, "device", "CPU"), threads=extra.get("threads"),
                      max_concurrent=int(extra.get("max_concurrent", 8)),
                      context_length=extra.get("context_length"),
                      prefill_chunk=int(extra.get("prefill_chunk", FleetConfig.prefill_chunk)),
                      prompt_cache_exact=bool(extra.get("prompt_cache_exact", False)))
    return launch_pipeline(cfg, progress, speculative=extra.get("speculative"))
