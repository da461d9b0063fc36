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
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from engine.pipeline.health import tune_data_socket
from engine.protocol import ErrorReply, ProtocolError, decode_frames, encode_frames
from engine.protocol.messages import GenerateRequest, TokenEvent, Usage
from engine.protocol.pipeline import (
    StageConfigure,
    StageFree,
    StagePing,
    StagePong,
    StageResult,
    StageStep,
)
from engine.runtime.chat import request_ids
from engine.runtime.detokenize import eos_token_ids
from engine.runtime.errors import error_code_of
from engine.pipeline.prompt_cache import Parked, ParkedStreams
from engine.runtime.generation import Generation, accept, finished, pick
from engine.scheduler.inbox import InboxEngine
from engine.core.interface import EngineError, EngineInfo
from engine.runtime import tool_format

log = logging.getLogger(__name__)

COORD_IDENTITY = b"coord"  # workers answer senders whose identity starts with this directly


@dataclass(frozen=True)
class PipelineConfig:
    max_concurrent: int = 8  # streams in the ring at once (each holds KV on every stage); more wait
    prompt_cache: int = 2  # finished streams kept on the stages for follow-up prompts (within max_concurrent)
    prefill_chunk: int = 512  # prompt tokens per step
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
class StageLink:
    """One stage as the coordinator sees it."""

    index: int  # ring position
    start: int  # first layer (inclusive)
    end: int  # last layer (exclusive)
    endpoint: str  # the worker's bind address: control, and data for stage 0
    proc: Any = None  # a Popen-like (poll(), pid) when this side owns the process
    log_path: Path | None = None  # the worker's log, quoted when it crashes
    pid: int | None = None  # learnt from its pong when there is no proc
    server_key: str = ""  # the worker's CURVE public key (its agent's); "" = plaintext

    @property
    def label(self) -> str:
        pid = self.proc.pid if self.proc is not None else self.pid
        return f"stage {self.index} (layers {self.start}–{self.end}" + (f", pid {pid})" if pid else ")")


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"exited with signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exited with signal {-code}"
    return f"exited with code {code}"


def log_tail(path: Path | None, limit: int = 200) -> str:
    if path is None:
        return ""
    try:
        lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " ".join(lines[-1].split())[:limit] if lines else ""


@dataclass
class _Flight:
    """One admitted request: its generation and where its stream stands."""

    gen: Generation  # sampler, detokenizer, output ids, timings
    stream_id: str  # unique for the engine's life (request ids may be reused)
    sample: bool  # needs the logits row (temperature > 0, a repetition penalty, logprobs)
    seq: int = 0  # the next step number
    past: int = 0  # tokens in its KV state on every stage
    in_flight: int = 0  # tokens of the step now in the ring; 0 = none
    sent_at: float = 0.0  # perf_counter when that step left
    spec: Any = None  # engine.pipeline.speculative.StreamSpeculation, or None (no speculation)
    keep: int | None = None  # a parked stream taken over: its first step keeps only this many tokens


@dataclass
class _Stats:
    steps: int = 0  # steps completed around the ring
    tokens: int = 0  # tokens generated
    stage_ms: list = field(default_factory=list)  # summed compute ms per stage
    ring_ms: float = 0.0  # summed send-to-result time of every step
    pongs: dict = field(default_factory=dict)  # stage index -> last StagePong


class PipelineEngine(InboxEngine):
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
        self._broken: str | None = None  # why the ring is unusable
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

    # -- setup -------------------------------------------------------------------
    def _open_sockets(self) -> None:
        self.ret = self._ctx.socket(zmq.ROUTER)
        self.ret.setsockopt(zmq.LINGER, 0)
        tune_data_socket(self.ret)  # ZMTP heartbeats (engine/pipeline/health.py)
        curve = self.config.curve
        if curve is not None:  # the return socket admits the stages' keys only
            self._zap = curve.serve(self._ctx, self.ret, [link.server_key for link in self.stages])
        self.ret.bind(self.config.return_bind)
        self.return_endpoint = self.config.return_endpoint or self.ret.getsockopt_string(zmq.LAST_ENDPOINT)
        me = COORD_IDENTITY + b"-" + uuid.uuid4().hex[:12].encode()
        self.ctl: list[zmq.Socket] = []
        for link in self.stages:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, me)
            s.setsockopt(zmq.SNDHWM, 0)  # the ring bounds what we queue: one step per stream
            tune_data_socket(s)
            if curve is not None:
                curve.client(s, link.server_key)
            s.connect(link.endpoint)
            self.ctl.append(s)

    def _configure_ring(self) -> None:
        """Tell every stage where to send; wait until each answers (= loaded and wired)."""
        n = len(self.stages)
        for i, link in enumerate(self.stages):
            nxt = self.stages[i + 1].endpoint if i + 1 < n else self.return_endpoint
            key = (self.stages[i + 1].server_key if i + 1 < n else
                   self.config.curve.public if self.config.curve is not None else "")
            self._send(i, StageConfigure(nxt, i, n, f"stage {i}", next_key=key))
        waiting = set(range(n))
        deadline = time.monotonic() + self.config.ready_timeout_s
        poller = zmq.Poller()
        for s in self.ctl:
            poller.register(s, zmq.POLLIN)
        while waiting:
            for i in list(waiting):
                dead = self._exit_reason(self.stages[i])
                if dead:
                    raise EngineError(dead)
            if time.monotonic() > deadline:
                names = ", ".join(self.stages[i].label for i in sorted(waiting))
                raise EngineError(f"{names} did not become ready within {self.config.ready_timeout_s:.0f} s")
            for sock, _ in poller.poll(100):
                i = self.ctl.index(sock)
                try:
                    msg, _t = decode_frames(sock.recv_multipart(copy=False))
                except ProtocolError as e:
                    if e.code == "version":  # never going to understand each other: say so now
                        raise EngineError(f"{self.stages[i].label} speaks another Flotilla protocol: {e}") from None
                    log.warning("pipeline: unreadable message from a stage: %s", e)
                    continue
                if isinstance(msg, StagePong) and msg.configured:
                    self._on_pong(i, msg)
                    waiting.discard(i)
                elif isinstance(msg, ErrorReply):
                    raise EngineError(f"{self.stages[i].label} refused its configuration: {msg.message}")
        self._last_pong = [time.monotonic()] * n

    def _close_sockets(self) -> None:
        with self._wake_lock:
            for s in [getattr(self, "ret", None), *getattr(self, "ctl", []), self._wake_rx, self._wake_tx]:
                if s is not None:
                    s.close(0)
            if getattr(self, "_zap", None) is not None:
                self._zap.stop()  # before term(): its socket lives in this context
            self._ctx.term()

    # -- Engine hooks ------------------------------------------------------------
    def _start(self, request: GenerateRequest) -> None:
        if self._broken:
            raise EngineError(self._broken, "peer_lost")
        super()._start(request)
        self._wake()

    def cancel(self, request_id: str) -> None:
        super().cancel(request_id)
        self._wake()

    def _shutdown(self) -> None:
        self._stop.set()
        self._wake()
        self._stop_scheduler()
        self._close_sockets()
        self.spec.close()
        if self._on_close is not None:
            self._on_close()

    def set_prompt_cache(self, streams: int) -> None:
        """Park at most this many finished streams from now on (0: none); the ones over it
        are freed on every stage before the next step goes out."""
        self._parked_want = max(0, int(streams))
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_tx.closed:
                return
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake is already pending

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
                if self._broken:
                    self._fail_all(waiting, active, self._broken)
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
            except Exception:  # a bug in the loop itself: log, keep serving
                log.exception("pipeline coordinator error")
                time.sleep(0.05)
        self._fail_all(waiting, active, "the engine was closed", "closed")
        self._flush_free()

    def _drain_wake(self) -> None:
        try:
            while True:
                self._wake_rx.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _drop_cancelled(self, waiting: collections.deque, active: dict[str, _Flight]) -> None:
        ids = self._take_cancelled(waiting, (f.gen.request_id for f in active.values()))
        for flight in [f for f in active.values() if f.gen.request_id in ids]:
            self._end(active, flight, finished(flight.gen, "cancelled"))

    def _admit(self, request: GenerateRequest, t_submit: float) -> _Flight | None:
        try:
            ids = request_ids(self.tokenizer, request)
            gen = Generation.create(request, ids, None, self.tokenizer, self.eos_ids,  # type: ignore[arg-type]
                                    self.context_length, self.config.prefill_chunk, t_submit)
        except Exception as e:
            self._emit(TokenEvent(request.request_id, finish_reason="error", error=_one_line(e),
                                  error_code=error_code_of(e), usage=Usage(0, 0)))
            return None
        s = request.sampling
        try:
            spec = self.spec.open(request, gen)
        except Exception as e:
            self._emit(TokenEvent(request.request_id, finish_reason="error", error=_one_line(e),
                                  error_code=error_code_of(e), usage=Usage(0, 0)))
            return None
        sample = s.temperature > 0 or s.repetition_penalty != 1.0 or s.logprobs is not None or request.constrained
        found = self.parked.take(ids) if spec is None else None
        if found is None:
            return _Flight(gen, f"s{next(self._ids)}", sample=sample, spec=spec)
        parked, keep = found
        gen.prefilled = gen.cached = keep
        return _Flight(gen, parked.stream_id, sample=sample, seq=parked.seq, past=parked.past, keep=keep)

    def _send_step(self, f: _Flight) -> None:
        if self.recovery.hold_send(f):  # paused by a recovery, or a replay chunk sent
            return
        gen = f.gen
        if f.spec is not None and f.spec.ready(gen):  # a speculative verify step
            step, ids = f.spec.build(f)
            f.in_flight, f.sent_at = ids.shape[1], time.perf_counter()
            self._send(0, step, [ids])  # token ids [1, k+1]
            return
        prompt = gen.prompt_ids
        if gen.prefilled < len(prompt):
            ids = prompt[gen.prefilled:gen.prefilled + gen.chunk]
            final = gen.prefilled + len(ids) == len(prompt)
        else:
            ids, final = [gen.pending], True
        step = StageStep(f.stream_id, f.seq, f.past, reset=f.past == 0, want_token=final,
                         want_logits=final and f.sample)
        if f.keep is not None:  # a parked stream taken over: drop what it holds past the shared prefix
            cut = (f.keep, f.past) if f.keep < f.past else ()
            step = dataclasses.replace(step, position=f.keep, hide=cut, compact=bool(cut))
            f.past, f.keep = f.keep, None
        if gen.t_start is None:
            gen.t_start = time.perf_counter()
        f.in_flight, f.sent_at = len(ids), time.perf_counter()
        self._send(0, step, [np.array([ids], np.int64)])  # token ids [1, n]

    def _drain(self, sock: zmq.Socket, active: dict[str, _Flight], routed: bool) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg, tensors = decode_frames(frames[1:] if routed else frames)
            except ProtocolError as e:
                log.warning("pipeline: unreadable message from a stage: %s", e)
                continue
            if isinstance(msg, StageResult):
                self._on_result(active, msg, tensors)
            elif isinstance(msg, StagePong):
                self._on_pong(self.ctl.index(sock) if not routed else None, msg)
            elif isinstance(msg, ErrorReply):
                self._on_error(active, msg)
            else:
                log.warning("pipeline: unexpected %s from a stage", msg.KIND)

    def _on_result(self, active: dict[str, _Flight], msg: StageResult, tensors: list[np.ndarray]) -> None:
        if self.recovery.take_result(active, msg):  # dropped during a recovery, or a replay chunk
            return
        f = active.get(msg.stream_id)
        if f is None or not f.in_flight or msg.seq != f.seq:
            return  # a late answer for a cancelled or finished stream
        gen, n = f.gen, f.in_flight
        self.stats.steps += 1
        self.stats.ring_ms += (time.perf_counter() - f.sent_at) * 1000.0
        for i, ms in enumerate(msg.stage_ms[:len(self.stats.stage_ms)]):
            self.stats.stage_ms[i] += ms
        f.seq += 1
        f.past += n
        f.in_flight = 0
        if f.spec is not None and f.spec.is_verify_result(f, msg):
            self._on_spec_result(active, f, msg, tensors, n)
            return
        if gen.prefilled < len(gen.prompt_ids):
            gen.prefilled += n
            if msg.token is None and gen.prefilled < len(gen.prompt_ids):
                return  # a prefill chunk done; the next one goes out this turn
        gen.pending = None
        try:
            token = self._pick(f, msg, tensors)
            event = accept(gen, token, tensors[0] if f.sample else None)
        except ValueError as e:
            self._end(active, f, finished(gen, "error", error=str(e)))
            return
        self.stats.tokens += 1
        if event.final:
            self._end(active, f, event)
        else:
            self._emit(event)

    def _on_spec_result(self, active: dict[str, _Flight], f: _Flight, msg: StageResult,
                        tensors: list[np.ndarray], n: int) -> None:
        """A verify step of n positions is back: emit the tokens it settled."""
        from engine.speculative.session import emit_tokens

        gen = f.gen
        gen.pending = None
        try:
            tokens = f.spec.on_result(f, msg, tensors, n)
        except ValueError as e:
            self._end(active, f, finished(gen, "error", error=str(e)))
            return
        event = emit_tokens(gen, tokens)
        self.stats.tokens += len(event.token_ids)
        if event.final:
            self._end(active, f, event)
        else:
            self._emit(event)

    def _pick(self, f: _Flight, msg: StageResult, tensors: list[np.ndarray]) -> int:
        if f.sample:
            if len(tensors) != 1 or tensors[0].ndim != 1 or tensors[0].dtype != np.float32:
                raise ValueError("the last stage did not return a logits row")
            return pick(f.gen, tensors[0])
        if msg.token is None or msg.token >= self.vocab_size:
            raise ValueError(f"the last stage returned no valid token ({msg.token})")
        return msg.token

    def _on_error(self, active: dict[str, _Flight], msg: ErrorReply) -> None:
        f = active.get(msg.request_id) if msg.request_id else None
        if f is None:
            log.warning("pipeline: a stage reported: %s (%s)", msg.message, msg.code)
            return
        self._end(active, f, finished(f.gen, "error", error=f"pipeline stage error: {msg.message}",
                                      error_code="peer_lost"))

    def _on_pong(self, index: int | None, msg: StagePong) -> None:
        if index is None:
            return
        self.stats.pongs[index] = msg
        if hasattr(self, "_last_pong"):
            self._last_pong[index] = time.monotonic()
        if self.stages[index].pid is None:
            self.stages[index].pid = msg.pid

    def _end(self, active: dict[str, _Flight], f: _Flight, event: TokenEvent) -> None:
        if f.spec is not None:
            try:
                f.spec.close()
            except Exception:  # never let speculation bookkeeping keep a request from ending
                log.exception("pipeline: closing the speculation of %s failed", f.stream_id)
        active.pop(f.stream_id, None)
        if f.spec is None and event.finish_reason in ("stop", "length") and not self._broken:
            ids = (list(f.gen.prompt_ids) + list(f.gen.output_ids))[:f.past]
            self._to_free += self.parked.park(Parked(f.stream_id, f.seq, f.past, tuple(ids)))
        else:
            self._to_free.append(f.stream_id)
        self._emit(event)

    def _flush_free(self) -> None:
        if not self._to_free or self._broken:
            self._to_free = []
            return
        msg = StageFree(tuple(self._to_free))
        self._to_free = []
        for i in range(len(self.stages)):
            self._send(i, msg)

    # -- health ------------------------------------------------------------------
    def _exit_reason(self, link: StageLink) -> str | None:
        if link.proc is None:
            return None
        code = link.proc.poll()
        if code is None:
            return None
        why = f"{link.label} {describe_exit(code)}"
        tail = log_tail(link.log_path) if code > 0 else ""
        return f"{why}: {tail}" if tail else why

    def _check_liveness(self) -> None:
        if self.recovery.enabled:  # detection + re-plan + replay (engine/pipeline/recovery.py)
            self.recovery.tick()
            return
        if self._broken:
            return
        for link in self.stages:
            reason = self._exit_reason(link)
            if reason:
                self._break(reason)
                return
        now = time.monotonic()
        for i, link in enumerate(self.stages):
            silent = now - self._last_pong[i]
            if silent > self.config.ping_timeout_s:
                self._break(f"{link.label} stopped answering for {silent:.0f} s")
                return

    def _ping_all(self, now: float) -> None:
        if self._broken:
            return
        nonce = next(self._nonce)
        for i in range(len(self.stages)):
            self._send(i, StagePing(nonce))

    def _break(self, reason: str) -> None:
        log.error("pipeline broken: %s", reason)
        self._broken = reason

    def _fail_all(self, waiting: collections.deque, active: dict[str, _Flight], reason: str,
                  code: str = "peer_lost") -> None:
        """End every request: the ring broke (a stage was lost) or, code "closed", the engine closed."""
        while waiting:
            req, _t = waiting.popleft()
            self._emit(TokenEvent(req.request_id, finish_reason="error", error=reason, error_code=code,
                                  usage=Usage(0, 0)))
        for f in list(active.values()):
            self._end(active, f, finished(f.gen, "error", error=reason, error_code=code))

    # -- wire --------------------------------------------------------------------
    def _send(self, i: int, msg: Any, tensors: list[np.ndarray] = ()) -> None:
        try:
            self.ctl[i].send_multipart(encode_frames(msg, list(tensors)), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            log.warning("pipeline: cannot send %s to %s: %s", msg.KIND, self.stages[i].label, e)


def _config_vocab(model_dir: Path) -> int:
    """vocab_size from config.json (the logits width; may exceed the tokenizer's)."""
    import json

    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    v = cfg.get("text_config", cfg).get("vocab_size")
    return v if isinstance(v, int) and v > 0 else 0


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:500]
