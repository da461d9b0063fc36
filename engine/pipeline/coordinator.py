"""PipelineEngine: the Engine interface over a ring of shard workers.

One coordinator thread owns every socket. Each turn it admits requests (up to
max_concurrent streams), sends the next step of every stream that has none in
the ring, then waits for results. A stream has at most one step in flight (a
token needs the previous one), so N streams keep up to N steps in the ring at
once: while stage 2 works for stream A, stage 1 works for stream B (request
interleaving; each stream has its own InferRequest and KV state on every
stage). Sending in admission order and one step per stream per turn keeps the
streams fair.

Per stream the coordinator keeps a Generation (engine/runtime/generation.py):
the sampler, the detokenizer with stop strings, timings and usage, exactly as
LocalEngine does. Greedy requests get the token id from the last stage;
requests that sample (temperature > 0 or a repetition penalty) get the
last-position logits row and sample here with their own RNG.

Speculative decoding (engine/pipeline/speculative.py) hooks in at three
points: admission opens a stream's speculation, _send_step lets it build a
verify step ([pending, d1..dk] with mask-rollback fields), and _on_result
hands a verify step's answer to _on_spec_result, which emits 1..k+1 tokens.

Failures: an ErrorReply about a stream ends that stream with an error event.
A stage process that exits (polled every liveness_interval_s) or stops
answering pings (ping_timeout_s) breaks the ring -- unless recovery is
enabled (enable_recovery; launch_pipeline does it): then engine/pipeline/
recovery.py re-plans, re-wires and replays every stream, and only when that
is impossible the ring breaks: every request ends with an
error event naming the stage, and new submits are refused with that reason.

PipelineEngine is split by concern: its sockets, ring configuration and stage
liveness are CoordinatorWire's (coordinator_wire.py), admission, steps and
results CoordinatorStreams' (coordinator_streams.py); StageLink is in
stage_link.py.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import zmq

from engine.core.interface import EngineError, EngineInfo
from engine.pipeline.coordinator_streams import CoordinatorStreams, _Flight
from engine.pipeline.coordinator_wire import CoordinatorWire
from engine.pipeline.prompt_cache import ParkedStreams
from engine.pipeline.stage_link import StageLink
from engine.protocol.messages import GenerateRequest, TokenEvent, Usage
from engine.protocol.pipeline import StagePong
from engine.runtime import tool_format
from engine.runtime.detokenize import eos_token_ids
from engine.runtime.generation import finished
from engine.scheduler.inbox import InboxEngine

# StageLink lives in stage_link.py; a ring's wiring imports it with the engine and its config.
__all__ = ["PipelineConfig", "PipelineEngine", "StageLink"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineConfig:
    max_concurrent: int = 8  # streams in the ring at once (each holds KV on every stage); more wait
    prompt_cache: int = 2  # finished streams kept on the stages for follow-up prompts (within max_concurrent)
    prefill_chunk: int = 512  # prompt tokens per step
    # a follow-up reuses only whole prefill chunks, so its answer is the uncached one at any
    # precision (engine/pipeline/prompt_cache.py; the stages need a 16-bit KV cache for it,
    # FleetConfig / the fleet's LaunchConfig.prompt_cache_exact start them so); costs up to a chunk of prefill
    prompt_cache_exact: bool = False
    context_length: int | None = None  # cap on prompt + answer tokens; None = the model's own
    return_bind: str = "tcp://127.0.0.1:*"  # where the last stage sends results (* = a free port)
    return_endpoint: str | None = None  # the address the last stage dials, when return_bind's host is a wildcard
    ready_timeout_s: float = 120.0  # every stage must answer its StageConfigure within this
    ping_interval_s: float = 0.5  # health pings to every stage
    # no pong for this long = the stage is gone; workers answer while computing (health.py), so a
    # short timeout gives no false alarms during long prefill chunks; detection <= timeout + 0.2 s
    ping_timeout_s: float = 2.5
    liveness_interval_s: float = 0.2  # how often local stage processes are polled for exit
    device: str = "CPU"  # shown in EngineInfo
    # CURVE on every data socket: an engine.transport.curve_data.CurveEnd (the coordinator's keys);
    # each StageLink then needs its server_key. None = plaintext (the local runner, when asked).
    curve: Any = None


@dataclass
class _Stats:
    steps: int = 0  # steps completed around the ring
    tokens: int = 0  # tokens generated
    stage_ms: list = field(default_factory=list)  # summed compute ms per stage
    ring_ms: float = 0.0  # summed send-to-result time of every step
    pongs: dict = field(default_factory=dict)  # stage index -> last StagePong


class PipelineEngine(CoordinatorWire, CoordinatorStreams, InboxEngine):
    def __init__(self, stages: Sequence[StageLink], model_dir: Path, model_id: str,
                 config: PipelineConfig = PipelineConfig(), on_close: Callable[[], None] | None = None,
                 tokenizer: Any = None, speculative: Any = None) -> None:
        super().__init__()
        if not stages:
            raise EngineError("a pipeline needs at least one stage")
        if config.max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        self.parked = ParkedStreams(config.prompt_cache)  # finished streams kept for follow-ups
        self._parked_want: int | None = None  # a new capacity, applied by the coordinator thread
        from engine.models.profile import engine_context

        self.stages = list(stages)
        self.model_id = model_id
        self.config = config
        self._on_close = on_close
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.tokenizer = tokenizer
        self.eos_ids = eos_token_ids(Path(model_dir), tokenizer)
        self.context_length = engine_context(model_dir, config.context_length)
        self.vocab_size = _config_vocab(Path(model_dir)) or len(tokenizer)
        from engine.pipeline.speculative import RingSpeculation
        from engine.speculative.config import SpecConfig

        # speculation defaults (speculative: a SpecConfig); a request's field overrides them
        self.spec = RingSpeculation(speculative or SpecConfig(), model_id, self.vocab_size, config.device)
        self.stats = _Stats(stage_ms=[0.0] * len(self.stages))
        self.broken: str | None = None  # why the ring is unusable
        self._ids = itertools.count()
        self._nonce = itertools.count(1)
        self._ctx = zmq.Context()
        # Other threads wake the loop through an inproc PAIR (portable, unlike polling a pipe
        # on Windows); the sending end is shared, so it is used under a lock.
        self._wake_lock = threading.Lock()
        wake_addr = f"inproc://pipeline-wake-{uuid.uuid4().hex}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.SNDHWM, 1)
        self._wake_tx.connect(wake_addr)
        from engine.pipeline.recovery import RingRecovery

        self.recovery = RingRecovery(self)  # disabled until enable_recovery() gives it a provider
        try:
            self._open_sockets()
            self._configure_ring()
        except BaseException:
            self._close_sockets()
            raise
        self._start_scheduler(f"flotilla-pipeline-{model_id}")

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.model_id, "pipeline", self.config.device, self.context_length,
                          tool_format.of(self.tokenizer).name)

    def stage_status(self) -> dict[int, StagePong]:
        """The last pong of every stage (queue depth, streams, compute ms)."""
        return dict(self.stats.pongs)

    # -- reliability (engine/pipeline/recovery.py) -------------------------------
    @property
    def max_concurrent(self) -> int:
        return self.config.max_concurrent

    def enable_recovery(self, provider: Any, config: Any = None) -> None:
        """Replace lost stages instead of failing: provider.replan(RingLoss) -> new ring
        (a RingProvider, or a plain callable); config: a recovery.RecoveryConfig."""
        self.recovery.set_provider(provider, config)

    def migrate_stage(self, index: int, reason: str = "the peer is needed by its user") -> Any:
        """Hand stage `index` over to a replacement while it still serves (a peer's user
        returned). Returns a concurrent.futures.Future of the RecoveryRecord: the peer may
        stop once it resolves."""
        return self.recovery.migrate(index, reason)

    def _health(self) -> tuple[str, str]:
        return self.recovery.status()

    # -- Engine hooks ------------------------------------------------------------
    def _start(self, request: GenerateRequest) -> None:
        if self.broken:
            raise EngineError(self.broken, "peer_lost")
        super()._start(request)
        self.wake()

    def cancel(self, request_id: str) -> None:
        super().cancel(request_id)
        self.wake()

    def _shutdown(self) -> None:
        self._stop.set()
        self.wake()
        self._stop_scheduler()
        self._close_sockets()
        self.spec.close()
        if self._on_close is not None:
            self._on_close()

    def set_prompt_cache(self, streams: int) -> None:
        """Park at most this many finished streams from now on (0: none); the ones over it
        are freed on every stage before the next step goes out."""
        self._parked_want = max(0, int(streams))
        self.wake()

    # -- the coordinator thread --------------------------------------------------
    def _run(self) -> None:
        waiting: collections.deque[tuple[GenerateRequest, float]] = collections.deque()
        active: dict[str, _Flight] = {}  # stream id -> flight, in admission order
        self._active = active  # for recovery (re-keys and replays flights)
        self._to_free: list[str] = []
        poller = zmq.Poller()
        self._poller = poller  # recovery swaps the control sockets registered here
        poller.register(self.ret, zmq.POLLIN)
        for s in self.ctl:
            poller.register(s, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_live = next_ping = 0.0
        while not self._stop.is_set():
            try:
                self._take_inbox(waiting, block=False)  # the poll below is the wait
                self._drop_cancelled(waiting, active)
                if self.broken:
                    self._fail_all(waiting, active, self.broken)
                want, self._parked_want = self._parked_want, None
                if want is not None:
                    self.parked.capacity = want
                    self._to_free += self.parked.evict(len(self.parked) - want)
                while waiting and len(active) < self.config.max_concurrent:
                    flight = self._admit(*waiting.popleft())  # may take over a parked stream
                    if flight is not None:
                        active[flight.stream_id] = flight
                    # parked streams hold KV like running ones: give their room back, and free
                    # them before any new stream's first step goes out
                    self._to_free += self.parked.evict(len(active) + len(self.parked) - self.config.max_concurrent)
                self._flush_free()
                for flight in active.values():
                    if not flight.in_flight:
                        self._send_step(flight)
                self._flush_free()
                timeout = max(0.0, min(next_live, next_ping) - time.monotonic())
                for sock, _ in poller.poll(timeout * 1000):
                    if sock is self._wake_rx:
                        self._drain_wake()
                    elif sock is self.ret:
                        self._drain(self.ret, active, routed=True)
                    else:
                        self._drain(sock, active, routed=False)
                now = time.monotonic()
                if now >= next_live:
                    next_live = now + self.config.liveness_interval_s
                    self._check_liveness()
                if now >= next_ping:
                    next_ping = now + self.config.ping_interval_s
                    self._ping_all(now)
            except Exception as e:  # a bug in a turn: retrying it would fail again, and its
                # requests' clients would wait forever, so those requests end with the error
                log.exception("pipeline coordinator error")
                self._fail_running(active, e)
                time.sleep(0.05)
        self._fail_all(waiting, active, "the engine was closed", "closed")
        self._flush_free()

    def _drop_cancelled(self, waiting: collections.deque, active: dict[str, _Flight]) -> None:
        ids = self._take_cancelled(waiting, (f.gen.request_id for f in active.values()))
        for flight in [f for f in active.values() if f.gen.request_id in ids]:
            self._end(active, flight, finished(flight.gen, "cancelled"))

    def _fail_all(self, waiting: collections.deque, active: dict[str, _Flight], reason: str,
                  code: str = "peer_lost") -> None:
        """End every request: the ring broke (a stage was lost) or, code "closed", the engine closed."""
        while waiting:
            req, _t = waiting.popleft()
            self._emit(TokenEvent(req.request_id, finish_reason="error", error=reason, error_code=code,
                                  usage=Usage(0, 0)))
        for f in list(active.values()):
            self._end(active, f, finished(f.gen, "error", error=reason, error_code=code))


def _config_vocab(model_dir: Path) -> int:
    """vocab_size from config.json (the logits width; may exceed the tokenizer's); 0 if unknown."""
    from engine.models.config_file import try_text_config

    v = try_text_config(model_dir).get("vocab_size")
    return v if isinstance(v, int) and v > 0 else 0
