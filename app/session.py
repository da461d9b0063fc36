"""The engine the whole app talks to: one at a time, shared by every chat
window, the plan editor (which launches it) and the API server (which serves it).

A small state machine, driven from the GUI thread; every engine call runs on
the Runner (app.background), so the GUI only reacts to signals:

    idle --open/launch--> opening --ok--> ready --open/launch--> opening ...
                             \\--error--> failed         any --shutdown--> closing

A newer open supersedes an older one (its engine is closed when it arrives).
A replaced engine is closed in the background; answers still streaming on it
end with the engine's "closed" error event, which the chat shows.
"""

from __future__ import annotations

import threading

from PySide6.QtCore import QObject, QTimer, Signal

from app.background import Runner
from engine import client

IDLE, OPENING, READY, FAILED, CLOSING = "idle", "opening", "ready", "failed", "closing"
LOAD_MS = 500  # how often the engine's queue is read while answers are in flight


def _open(spec: str, kind: str, device: str, settings: dict, progress) -> tuple:
    engine = client.open_engine(spec, device=device, progress=progress, kind=kind, **settings)
    return engine, engine.info  # read info here too: it is an engine call


def _launch(spec: str, plan, cancel: threading.Event, speculative, recover: bool, exact_cache: bool,
            progress) -> tuple:
    engine = client.launch_pipeline(spec, plan, step=lambda s: progress(s), cancel=cancel,
                                    speculative=speculative, recover=recover, prompt_cache_exact=exact_cache)
    return engine, engine.info


def _launch_fleet(spec: str, plan, cards: list, cancel: threading.Event, exact_cache: bool, progress) -> tuple:
    engine = client.launch_fleet(spec, plan, cards, step=lambda s: progress(s), cancel=cancel,
                                 prompt_cache_exact=exact_cache)
    return engine, engine.info


def plan_summary(plan, names: dict | None = None) -> str:
    """'2 stages: 0–4 | 4–8 · int4 weights' (what the status bar and the plan editor say is running)."""
    names = names or {}
    parts = " | ".join(f"{names[s.peer_id]} {s.start}–{s.end}" if s.peer_id in names else f"{s.start}–{s.end}"
                       for s in plan.stages)
    what = "peers" if names else "stages"
    return f"{len(plan.stages)} {what}: {parts} · {client.plan_precision(plan)} weights"


class EngineSession(QObject):
    changed = Signal()  # state, engine or description changed
    progress = Signal(str, float)  # while opening: what is happening, 0..1
    launch_step = Signal(object)  # client.LaunchStep while a pipeline launches
    failed = Signal(str)  # an open or launch failed: the reason
    closed = Signal()  # shutdown() finished
    load_changed = Signal()  # answering / running / queued changed

    def __init__(self, runner: Runner, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.runner = runner
        self.state = IDLE
        self.engine: client.Engine | None = None
        self.info: client.EngineInfo | None = None
        self.spec = ""
        self.kind = "local"
        self.plan_text = ""  # "2 stages: 0–4 | 4–8 · f32 weights" for a pipeline, "" otherwise
        self.plan = None  # the Plan launched (the editor's very object), None for other engines
        self.error = ""  # why the last open failed
        # stage index -> why its agent refused it ("over its owner's RAM limit...: needs 3.10 GB, ..."),
        # from the refusal's fields (engine/fleet/refusal.py), for the launch rows; {} otherwise
        self.refused: dict[int, str] = {}
        self._generation = 0
        self._cancel: threading.Event | None = None
        self.answering = 0  # this app's answers in flight (every chat window)
        self.running: int | None = None  # the engine's own count (engine.load()), None = it cannot say
        self.queued: int | None = None  # ... of requests waiting for a slot
        self._load_timer = QTimer(self, interval=LOAD_MS)
        self._load_timer.timeout.connect(self._read_load)
        self._reading = False

    # -- reading ------------------------------------------------------------------
    def label(self) -> str:
        """'demo · local · CPU' (what the chat stats and status bar show)."""
        if self.info is None:
            return self.spec or "no engine"
        return f"{self.info.model_id} · {self.info.engine} · {self.info.device}"

    @property
    def is_ready(self) -> bool:
        return self.state == READY and self.engine is not None

    def load_text(self) -> str:
        """'3 queued' (the engine's queue, or this app's own answers when the engine
        cannot say), '' when nothing waits."""
        if self.queued is not None:
            return f"{self.queued} queued" if self.queued > 0 else ""
        return f"{self.answering} answering" if self.answering > 1 else ""

    # -- answers in flight (queue display) -------------------------------------------
    def answer_started(self) -> None:
        self.answering += 1
        if not self._load_timer.isActive():
            self._load_timer.start()
        self._read_load()

    def answer_ended(self) -> None:
        self.answering = max(0, self.answering - 1)
        if self.answering == 0:
            self._load_timer.stop()
            self.running = self.queued = None
        self.load_changed.emit()

    def _read_load(self) -> None:
        engine = self.engine
        if engine is None or self._reading:
            return
        self._reading = True
        task = self.runner.call(client.engine_load, engine, name="load")
        task.result.connect(self._set_load)
        task.finished.connect(lambda: setattr(self, "_reading", False))

    def _set_load(self, load: tuple | None) -> None:
        if self.answering == 0:
            return
        self.running, self.queued = load if load is not None else (None, None)
        self.load_changed.emit()

    # -- opening ------------------------------------------------------------------
    def open(self, spec: str, kind: str = "local", device: str = "CPU", **settings) -> None:
        """Replace the engine with `kind` on `spec` (settings: context_length,
        streams, cache_budget_bytes)."""
        self._begin(spec, kind, "")
        generation = self._generation
        task = self.runner.call(_open, spec, kind, device, settings, report_to="progress", name="open")
        task.item.connect(lambda v: self._on_progress(generation, v))
        task.result.connect(lambda res: self._on_opened(generation, res))
        task.failed.connect(lambda exc: self._on_failed(generation, exc))

    def launch_pipeline(self, spec: str, plan, speculative: client.SpecChoice | None = None,
                        recover: bool = True, exact_cache: bool = False) -> None:
        """Start `plan` (the editor's Plan over this PC's stages: one worker process per stage) as is
        and make it the engine. exact_cache: the exact prompt cache (client.launch_pipeline)."""
        self._begin(spec, "pipeline", plan_summary(plan), plan)
        generation = self._generation
        self._cancel = cancel = threading.Event()
        task = self.runner.call(_launch, spec, plan, cancel, speculative, recover, exact_cache, report_to="progress",
                                name="launch")
        self._follow_launch(task, generation)

    def launch_fleet(self, spec: str, plan, cards: list, exact_cache: bool = False) -> None:
        """Start `plan` (the editor's Plan: node id and device per stage) on fleet agents as is and make
        it the engine. exact_cache: the exact prompt cache (client.launch_fleet)."""
        names = {c.peer_id: c.name for c in cards}
        self._begin(spec, "pipeline", plan_summary(plan, {s.peer_id: names.get(s.peer_id, s.peer_id[:8])
                                                       for s in plan.stages}), plan)
        generation = self._generation
        self._cancel = cancel = threading.Event()
        task = self.runner.call(_launch_fleet, spec, plan, list(cards), cancel, exact_cache, report_to="progress",
                                name="launch-fleet")
        self._follow_launch(task, generation)

    def _follow_launch(self, task, generation: int) -> None:
        task.item.connect(lambda v: self._on_step(generation, v[0]))
        task.result.connect(lambda res: self._on_opened(generation, res))
        task.failed.connect(lambda exc: self._on_failed(generation, exc))

    def cancel_launch(self) -> None:
        """Stop a pipeline launch: every stage process is stopped; the state becomes failed."""
        if self._cancel is not None and self.state == OPENING:
            self._cancel.set()

    def _begin(self, spec: str, kind: str, plan_text: str, plan=None) -> None:
        self._generation += 1
        if self._cancel is not None:
            self._cancel.set()  # a launch still running is superseded
        if self.engine is not None:
            self._close_async(self.engine)
        self.engine = self.info = None
        self.spec, self.kind, self.plan_text, self.plan, self.error = spec, kind, plan_text, plan, ""
        self.refused = {}
        self._set(OPENING)

    def _on_progress(self, generation: int, values: tuple) -> None:
        if generation == self._generation and self.state == OPENING:
            message, fraction = (list(values) + ["", 0.0])[:2]
            self.progress.emit(str(message), float(fraction or 0.0))

    def _on_step(self, generation: int, step: client.LaunchStep) -> None:
        if generation == self._generation and self.state == OPENING:
            self.launch_step.emit(step)
            self.progress.emit(f"stage {step.stage}: {step.message}", step.fraction)

    def _on_opened(self, generation: int, res: tuple) -> None:
        engine, info = res
        if generation != self._generation or self.state == CLOSING:
            self._close_async(engine)  # superseded, or the app is leaving
            return
        self._cancel = None
        self.engine, self.info = engine, info
        self._set(READY)

    def _on_failed(self, generation: int, exc: BaseException) -> None:
        if generation != self._generation or self.state == CLOSING:
            return
        self._cancel = None
        cancelled = isinstance(exc, client.LaunchCancelled)
        self.error = "launch cancelled" if cancelled else (str(exc) or type(exc).__name__)
        # A fleet launch refused by agents (StageRefused) says, per stage, why in fields.
        self.refused = {r.stage: r.why() for r in getattr(exc, "refusals", ())}
        self._set(FAILED)
        self.failed.emit(self.error)

    def mark_broken(self, reason: str) -> None:
        """An answer reported the engine unusable (a stage process died)."""
        if self.state == READY:
            self.error = reason
            engine, self.engine = self.engine, None
            if engine is not None:
                self._close_async(engine)  # stops the stage processes still alive
            self._set(FAILED)
            self.failed.emit(reason)

    # -- closing ------------------------------------------------------------------
    def _close_async(self, engine: client.Engine) -> None:
        task = self.runner.call(engine.close, name="close")
        task.failed.connect(lambda exc: None)  # closing is best effort

    def shutdown(self) -> None:
        """Close the engine in the background; `closed` fires when it is done."""
        if self.state == CLOSING:
            return
        self._generation += 1
        if self._cancel is not None:
            self._cancel.set()
        engine, self.engine, self.info = self.engine, None, None
        self._set(CLOSING)
        if engine is None:
            self.closed.emit()
            return
        task = self.runner.call(engine.close, name="close")
        task.finished.connect(self.closed.emit)

    def _set(self, state: str) -> None:
        self.state = state
        self.changed.emit()
