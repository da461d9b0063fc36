"""CoordinatorStreams: PipelineEngine's streams: admission, the next step of each, its results.

A mixin of PipelineEngine (coordinator.py), run on its coordinator thread: a
_Flight per admitted request, the step it sends (prefill chunk, decode token or
speculative verify), and what each StageResult does to its Generation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zmq

from engine.pipeline.prompt_cache import Parked
from engine.protocol import ErrorReply, ProtocolError, decode_frames
from engine.protocol.messages import GenerateRequest, TokenEvent, Usage
from engine.protocol.pipeline import StageFree, StagePong, StageResult, StageStep
from engine.runtime.chat import request_ids
from engine.runtime.errors import error_code_of, one_line
from engine.runtime.generation import Generation, accept, finished, pick
from engine.scheduler.inbox import step_failed

log = logging.getLogger(__name__)


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


class CoordinatorStreams:
    """Admission, steps and results of every stream (a PipelineEngine mixin)."""

    # -- the coordinator thread --------------------------------------------------
    def _admit(self, request: GenerateRequest, t_submit: float) -> _Flight | None:
        """A flight for `request`, or None: it was refused (it ended with an error event)."""
        try:
            return self._new_flight(request, t_submit)
        except Exception as e:  # its prompt, its speculation, a parked stream: never a lost request
            self._emit(TokenEvent(request.request_id, finish_reason="error", error=one_line(e),
                                  error_code=error_code_of(e), usage=Usage(0, 0)))
            return None

    def _new_flight(self, request: GenerateRequest, t_submit: float) -> _Flight:
        ids = request_ids(self.tokenizer, request)
        gen = Generation.create(request, ids, None, self.tokenizer, self.eos_ids,  # type: ignore[arg-type]
                                self.context_length, self.config.prefill_chunk, t_submit)
        s = request.sampling
        spec = self.spec.open(request, gen)
        sample = s.temperature > 0 or s.repetition_penalty != 1.0 or s.logprobs is not None or request.constrained
        grid = gen.chunk if self.config.prompt_cache_exact else 1
        found = self.parked.take(ids, grid) if spec is None else None
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
            self.send_to_stage(0, step, [ids])  # token ids [1, k+1]
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
            step = msgspec.structs.replace(step, position=f.keep, hide=cut, compact=bool(cut))
            f.past, f.keep = f.keep, None
        if gen.t_start is None:
            gen.t_start = time.perf_counter()
        f.in_flight, f.sent_at = len(ids), time.perf_counter()
        self.send_to_stage(0, step, [np.array([ids], np.int64)])  # token ids [1, n]

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

    def _fail_running(self, active: dict[str, _Flight], err: Exception) -> None:
        """A turn of the coordinator raised: every admitted request ends (step_failed) and its
        stream is freed on every stage; a step of theirs still in the ring is dropped when
        it comes back (no flight has its id). Waiting requests are admitted as usual."""
        for f in list(active.values()):
            try:
                self._end(active, f, step_failed(f.gen, err))
            except Exception:  # _end failed part way: drop the flight all the same
                log.exception("pipeline: ending %s after a coordinator error", f.stream_id)
                active.pop(f.stream_id, None)

    def _end(self, active: dict[str, _Flight], f: _Flight, event: TokenEvent) -> None:
        if f.spec is not None:
            try:
                f.spec.close()
            except Exception:  # never let speculation bookkeeping keep a request from ending
                log.exception("pipeline: closing the speculation of %s failed", f.stream_id)
        active.pop(f.stream_id, None)
        if f.spec is None and event.finish_reason in ("stop", "length") and not self.broken:
            ids = (list(f.gen.prompt_ids) + list(f.gen.output_ids))[:f.past]
            # its prompt was prefilled in chunks on the grid from 0 (or from a whole-chunk
            # take-over); the last, partial chunk and the answer's one-token steps were not
            exact = len(f.gen.prompt_ids) - len(f.gen.prompt_ids) % f.gen.chunk
            self._to_free += self.parked.park(Parked(f.stream_id, f.seq, f.past, tuple(ids), exact))
        else:
            self._to_free.append(f.stream_id)
        self._emit(event)

    def _flush_free(self) -> None:
        if not self._to_free or self.broken:
            self._to_free = []
            return
        msg = StageFree(tuple(self._to_free))
        self._to_free = []
        for i in range(len(self.stages)):
            self.send_to_stage(i, msg)
