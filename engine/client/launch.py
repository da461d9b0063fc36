"""Launching a plan as a pipeline on this PC, and the live ring view of a running pipeline."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from engine.client.engines import SpecChoice, spec_config
from engine.core.interface import Engine, EngineError

if TYPE_CHECKING:
    from engine.planner.plan import Plan


@dataclass(frozen=True)
class LaunchStep:
    """Progress of one stage while a pipeline launches."""

    stage: int  # ring position; -1 = the whole launch
    phase: str  # "waiting" | "transfer" | "compile" | "ready" | "failed"
    fraction: float  # of the whole launch, 0..1
    message: str  # one line for people


class LaunchCancelled(EngineError):
    """The user cancelled a launch; every stage process was stopped."""


def launch_pipeline(spec: str, plan: Plan, step: Callable[[LaunchStep], None] | None = None,
                    cancel: threading.Event | None = None, speculative: SpecChoice | None = None,
                    recover: bool = True, prompt_cache_exact: bool = False) -> Engine:
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
    stage dies (recovery, not launch); `prompt_cache_exact`: follow-ups reuse
    whole prefill chunks and the stages keep a 16-bit KV cache (FleetConfig)."""
    from engine.planner.weights import refuse
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
                      max_concurrent=plan.streams, recover=recover, prompt_cache_exact=prompt_cache_exact)

    def same_plan(launched: Plan) -> None:  # the runner evaluated exactly this plan; say so if not
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
        engine = run(cfg, None, speculative=spec_config(speculative), on_stage=on_stage, cancel=cancel,
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
    return RingSnapshot(tuple(out), link_ms, stats.tokens, getattr(engine, "broken", None))


def stage_pids(engine: Engine | None) -> list[int]:
    """Process ids of a local pipeline's stage workers (empty for other engines)."""
    return [link.proc.pid for link in getattr(engine, "stages", []) or [] if link.proc is not None]
