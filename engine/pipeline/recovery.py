"""Keep every stream alive when a pipeline stage goes: re-plan, re-wire, replay.

    engine.enable_recovery(provider)          # launch_pipeline does it for local fleets
    engine.migrate_stage(1, "user returned")  # a peer hands its shard back: a Future
    engine.recovery.records                   # what happened, with timings

Each stream has KV state on every stage, so losing any stage loses the state
of every stream. What the coordinator still has for each stream is enough to
rebuild it: the prompt and every token it already gave the user
(Generation.prompt_ids + output_ids). Recovery:

1. detect (tick(), every liveness_interval_s on the coordinator thread): a
   local stage process exited; a stage answered no ping for ping_timeout_s
   (workers answer pings while computing: engine/shards/health.py); or a
   step sat in the ring for step_timeout_s while every stage answers (the
   data plane between two stages is down).
2. pause: no step leaves; results still arriving are dropped (each would be
   recomputed, so none is shown twice or lost).
3. re-plan (on a helper thread, the coordinator keeps serving cancels): the
   provider returns the new ring, every stage ready to be configured. For
   the local runner that is a warm standby worker loading the lost shard
   (engine/pipeline/standby.py); the fleet launcher supplies its own for
   real peers (replan_onto() helps it choose). RecoveryImpossible(reason)
   = nothing can host the model any more.
4. re-wire: new control sockets, StageConfigure to every stage (survivors
   just reconnect their output), StageFree of every old stream id.
5. replay: every stream gets a new stream id and prefills prompt + its
   generated tokens (prefill_chunk at a time). The last replay chunk returns
   the next token, which is handled exactly like the token the lost step
   would have returned: same Generation, same sampler state. Greedy output is
   the same as without the loss, and no token is shown twice or skipped.

A graceful migration (migrate_stage) is the same, except that the old stage
keeps serving while the replacement gets ready; the pause only covers the
re-wire and the replay. Recoveries are bounded (max_recoveries per window_s);
past that, or when the provider gives up, every stream ends with an error
event that says why, and submit() refuses with the same reason.

The provider's side (RingLoss, RingProvider, RecoveryImpossible, replan_onto)
is in recovery_provider.py; steps 4 and 5 are RingRecovery's mixins
RecoveryRewire (recovery_rewire.py) and RecoveryReplay (recovery_replay.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.pipeline.recovery_provider import RecoveryImpossible, RingLoss, _CallableProvider
from engine.pipeline.recovery_replay import RecoveryReplay
from engine.pipeline.recovery_rewire import RecoveryRewire

if TYPE_CHECKING:
    from engine.pipeline.coordinator import PipelineEngine
    from engine.pipeline.recovery_replay import _Replay

# RecoveryImpossible lives in recovery_provider.py; a provider raises it, callers catch it from here.
__all__ = ["RecoveryConfig", "RecoveryImpossible", "RecoveryRecord", "RingRecovery"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryConfig:
    max_recoveries: int = 20  # at most this many recoveries within window_s; more = give up
    window_s: float = 300.0  # see max_recoveries
    step_timeout_s: float = 10.0  # a step in the ring this long (+ 10 s per 512 tokens) = data plane down
    rewire_timeout_s: float = 15.0  # every stage of the new ring must answer its StageConfigure within this


@dataclass
class RecoveryRecord:
    """One recovery, for status displays, benchmarks and docs/reliability.md."""

    reason: str  # what was detected
    lost: tuple[int, ...]  # ring positions replaced
    graceful: bool  # a migration rather than a loss
    detected: float  # time.monotonic() of detection
    replan_s: float = 0.0  # provider time (replacement started and loaded)
    rewire_s: float = 0.0  # StageConfigure round trip of the new ring
    resume_s: float = 0.0  # detection -> every affected stream had its next token (or ended)
    streams: int = 0  # streams replayed
    replayed_tokens: int = 0  # tokens prefilled again
    ok: bool = False  # the ring runs again
    error: str = ""  # why not
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future, repr=False)

    def to_dict(self) -> dict:
        return {"reason": self.reason, "lost": list(self.lost), "graceful": self.graceful,
                "replan_s": round(self.replan_s, 3), "rewire_s": round(self.rewire_s, 3),
                "resume_s": round(self.resume_s, 3), "streams": self.streams,
                "replayed_tokens": self.replayed_tokens, "ok": self.ok, "error": self.error}


class RingRecovery(RecoveryRewire, RecoveryReplay):
    """Owned by a PipelineEngine; every method except migrate() runs on its coordinator thread."""

    def __init__(self, engine: "PipelineEngine", provider: Any = None,
                 config: RecoveryConfig = RecoveryConfig()) -> None:
        self.engine = engine
        self.provider = provider
        self.config = config
        self.records: list[RecoveryRecord] = []
        self.state = "ok"  # ok | replanning | broken
        self.paused = False  # no step leaves; results are dropped
        self._current: RecoveryRecord | None = None
        self._future: concurrent.futures.Future | None = None
        self._loss: RingLoss | None = None
        self._migrations: queue.SimpleQueue = queue.SimpleQueue()
        self._replays: dict[str, _Replay] = {}
        self._resuming: set[str] = set()  # stream ids still to produce their first token after a recovery
        self._stalls = 0  # consecutive data-plane stalls without progress

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def set_provider(self, provider: Any, config: RecoveryConfig | None = None) -> None:
        if provider is not None and not hasattr(provider, "replan"):
            provider = _CallableProvider(provider)
        self.provider = provider
        if config is not None:
            self.config = config

    def status(self) -> tuple[str, str]:
        """(state, detail) for Engine.load()."""
        if self.engine.broken:
            return "broken", self.engine.broken
        if self.state == "replanning" or self.paused or self._replays:
            return "recovering", self._current.reason if self._current else ""
        return "ok", ""

    # -- API (any thread) -----------------------------------------------------
    def migrate(self, index: int, reason: str) -> concurrent.futures.Future:
        """Ask for stage `index` to be replaced while it still serves; the Future
        gets the RecoveryRecord once the new ring runs (or the exception)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.enabled:
            fut.set_exception(RecoveryImpossible("this pipeline has no re-plan provider"))
            return fut
        if not 0 <= index < len(self.engine.stages):
            fut.set_exception(IndexError(f"no stage {index} in a ring of {len(self.engine.stages)}"))
            return fut
        self._migrations.put((self.engine.stages[index], reason, fut))
        self.engine.wake()
        return fut

    # -- coordinator thread: detection -----------------------------------------
    def tick(self) -> None:
        """Called instead of the engine's own liveness check when recovery is enabled."""
        e = self.engine
        if e.broken:
            return
        now = time.monotonic()
        if self.state == "replanning":
            lost = self._lost_stages(now, skip=set(self._loss.lost) if self._loss else set())
            if self._loss is not None and self._loss.graceful and any(i in self._loss.lost for i in
                                                                      self._lost_stages(now)):
                self.paused = True  # the migrating stage died before the hand-over: stop sending
            if lost:
                log.warning("pipeline: %s lost while recovering; handled after this recovery",
                            ", ".join(e.stages[i].label for i in lost))
            if self._future is not None and self._future.done():
                self._finish_replan()
            return
        lost = self._lost_stages(now)
        if lost:
            self._start(tuple(sorted(lost)), "; ".join(lost.values()), graceful=False)
            return
        if self._check_stall(now):
            return
        self._check_resumed()
        try:
            link, reason, fut = self._migrations.get_nowait()
        except queue.Empty:
            return
        if link not in e.stages:
            fut.set_exception(RecoveryImpossible(f"{link.label} is no longer in the ring"))
            return
        self._start((e.stages.index(link),), f"{link.label}: {reason}", graceful=True, future=fut)

    def _lost_stages(self, now: float, skip: set[int] = frozenset()) -> dict[int, str]:
        e = self.engine
        out: dict[int, str] = {}
        for i, link in enumerate(e.stages):
            if i in skip:
                continue
            reason = e._exit_reason(link)
            if reason is None:
                silent = now - e._last_pong[i]
                if silent > e.config.ping_timeout_s:
                    reason = f"{link.label} stopped answering for {silent:.1f} s"
            if reason:
                out[i] = reason
        return out

    def _check_stall(self, now: float) -> bool:
        """A step stuck in the ring while every stage answers pings = the data plane is down."""
        e = self.engine
        active = getattr(e, "_active", {})
        t = time.perf_counter()
        for f in active.values():
            if not f.in_flight or self.paused:
                continue
            limit = self.config.step_timeout_s * (1.0 + f.in_flight / 512.0)
            if t - f.sent_at > limit:
                self._stalls += 1
                reason = (f"a step of {len(e.stages)} stages took over {limit:.0f} s while every stage "
                          f"answers: the connection between two stages is down")
                if self._stalls > 2:
                    self._give_up(f"{reason} (still after {self._stalls - 1} re-wirings)")
                else:
                    self._start((), reason, graceful=False)
                return True
        return False

    def _check_resumed(self) -> None:
        rec = self._current
        if rec is None or rec.done.done():
            return
        active = getattr(self.engine, "_active", {})
        self._resuming &= set(active)
        if not self._resuming and not self._replays:
            rec.resume_s = time.monotonic() - rec.detected
            rec.ok = True
            self._stalls = 0
            log.warning("pipeline: recovered from %s in %.2f s (%d streams, %d tokens replayed)",
                        rec.reason, rec.resume_s, rec.streams, rec.replayed_tokens)
            rec.done.set_result(rec)

    # -- coordinator thread: re-plan and re-wire ----------------------------------
    def _start(self, lost: tuple[int, ...], reason: str, graceful: bool,
               future: concurrent.futures.Future | None = None) -> None:
        e = self.engine
        now = time.monotonic()
        if self._current is not None and not self._current.done.done():  # superseded
            self._current.error = "superseded by another loss"
            self._current.done.set_exception(RecoveryImpossible(f"another loss came first: {reason}"))
        recent = [r for r in self.records if now - r.detected < self.config.window_s]
        if len(recent) >= self.config.max_recoveries:
            self._give_up(f"{reason} ({len(recent)} recoveries in the last "
                          f"{self.config.window_s:.0f} s: the fleet is too unstable)")
            return
        rec = RecoveryRecord(reason, lost, graceful, now)
        if future is not None:
            rec.done.add_done_callback(lambda f: _copy_future(f, future))
        self.records.append(rec)
        self._current = rec
        log.error("pipeline: %s; %s", reason, "migrating" if graceful else "recovering")
        self.state = "replanning"
        self.paused = not graceful
        loss = RingLoss(lost, reason, tuple(e.stages), graceful)
        self._loss = loss
        if not lost:  # a stall: same stages, re-wired
            self._future = concurrent.futures.Future()
            self._future.set_result(list(e.stages))
            self._finish_replan()
            return
        self._future = concurrent.futures.Future()
        fut = self._future
        provider = self.provider

        def run() -> None:
            try:
                fut.set_result(list(provider.replan(loss)))
            except BaseException as ex:  # noqa: BLE001 - reported on the coordinator thread
                fut.set_exception(ex)
            e.wake()

        threading.Thread(target=run, name="pipeline-replan", daemon=True).start()

    def _finish_replan(self) -> None:
        e, rec, loss = self.engine, self._current, self._loss
        assert self._future is not None and rec is not None and loss is not None
        fut, self._future = self._future, None
        rec.replan_s = time.monotonic() - rec.detected
        try:
            links = fut.result()
        except RecoveryImpossible as ex:
            self._give_up(f"{loss.reason}; {ex}")
            return
        except Exception as ex:  # noqa: BLE001
            log.exception("pipeline: the re-plan failed")
            self._give_up(f"{loss.reason}; the re-plan failed: {_one_line(ex)}")
            return
        if not links:
            self._give_up(f"{loss.reason}; no peer can host the model any more")
            return
        t = time.perf_counter()
        old = list(e.stages)
        try:
            dead = self._rewire(links)
        except Exception as ex:  # noqa: BLE001
            log.exception("pipeline: re-wiring failed")
            self._give_up(f"{loss.reason}; re-wiring the ring failed: {_one_line(ex)}")
            return
        rec.rewire_s = time.perf_counter() - t
        retired = [link for link in old if link not in links]
        if retired and self.provider is not None:
            try:
                self.provider.retire(retired, loss.reason)
            except Exception:  # noqa: BLE001
                log.exception("pipeline: retiring old stages failed")
        self.state = "ok"
        self.paused = False
        self._replay_all(rec)
        if dead:  # a new stage failed to come up: recover again at once
            self._start(tuple(sorted(dead)), "; ".join(dead.values()), graceful=False)

    def _give_up(self, reason: str) -> None:
        self.state = "broken"
        self.paused = False
        self._replays.clear()
        rec = self._current
        if rec is not None and not rec.done.done():
            rec.error = reason
            rec.done.set_exception(RecoveryImpossible(reason))
        self.engine.break_ring(reason)


def _copy_future(src: concurrent.futures.Future, dst: concurrent.futures.Future) -> None:
    if dst.done():
        return
    if src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


def _one_line(e: BaseException) -> str:
    return (" ".join(str(e).split()) or type(e).__name__)[:300]
