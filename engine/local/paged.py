"""PagedEngine: one model on this machine, every running request in one forward pass.

The model runs over a paged KV cache (engine/runtime/ov_paged.py, OpenVINO's own
paged attention, the one openvino_genai's continuous batching uses), and this
scheduler thread drives it: each turn, one infer() advances every running request
-- a token for each one decoding, plus chunks of new prompts up to a token budget
(`prefill_chunk`), so a long prompt never stalls the others for long. The logits
rows come back here, and everything from there is the local engine's own code:
the grammar's mask and the sampler (generation.pick), text, stop strings, limits,
logprobs with alternatives (generation.accept). So every field the local engine
honours -- JSON schemas, forced tool calls, top_logprobs -- works here too, and
several users share a forward pass instead of dividing the PC's speed.

KV blocks (engine/runtime/kv_blocks.py): a request gets blocks as it grows. When
the pool runs dry, the request admitted last gives its blocks back and is fed again
later (its tokens so far re-prefilled: preemption by recompute); the answer it
streams is unchanged. A prompt whose leading whole blocks an ended answer left in
the pool takes them over and prefills only the rest (prompt caching; usage reports
them as cached_tokens).

Speculative decoding (a request's `speculative` field, or the engine's default): a
speculating request's part of the pass is [its last token, d1..dk] with the logits of
every position; the rejected drafts are rolled back by shortening its KV (the next
pass overwrites their slots), the same SpecSession as on the loop engine.

The pool holds every running request at the full context (max_concurrent x context
tokens), at most kv_budget_bytes (2 GiB); kept blocks of ended answers live in the
room running requests leave, so caching adds nothing past that bound.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.models.profile import engine_context
from engine.protocol.errors import one_line
from engine.protocol.messages import GenerateRequest, TokenEvent, Usage
from engine.runtime import tool_format
from engine.runtime.backend import Progress
from engine.runtime.chat import request_ids
from engine.runtime.detokenize import eos_token_ids
from engine.runtime.errors import error_code_of
from engine.runtime.generation import Generation, accept, finished, pick
from engine.runtime.kv_blocks import BlockPool
from engine.runtime.ov_paged import PagedModel, SeqWork
from engine.scheduler.inbox import TurnEngine
from engine.core.interface import EngineError, EngineInfo
from engine.speculative.session import emit_tokens

log = logging.getLogger(__name__)

KV_BUDGET_BYTES = 2 << 30  # the KV pool at most (its pages are resident once written)


@dataclass
class PagedSeq:
    """A request's KV in the pool: what Generation.stream holds on this engine."""

    pool: BlockPool
    blocks: list[int]  # its block table
    fed: list[int]  # ids whose KV the blocks hold, in order
    todo: list[int]  # ids still to feed (the prompt's rest, the last picked token)
    cached: int = 0  # prompt ids taken over from an earlier answer's blocks
    admitted: int = 0  # admission order: the last admitted is preempted first
    closed: bool = False

    @property
    def past(self) -> int:
        return len(self.fed)

    def preempt(self) -> None:
        """Give the blocks back; everything fed so far is fed again later."""
        self.pool.release(self.blocks, ())
        self.todo = self.fed + self.todo
        self.fed, self.blocks = [], []

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.release(self.blocks, self.fed)
            self.blocks = []


class PagedEngine(TurnEngine):
    def __init__(self, model_path: Path, model_id: str, device: str = "CPU", precision: str = "default",
                 max_concurrent: int = 8, context_length: int | None = None,
                 progress: Progress | None = None, prefill_chunk: int = 512,
                 kv_budget_bytes: int = KV_BUDGET_BYTES, max_blocks: int | None = None,
                 prompt_cache: bool = True, speculative: Any = None) -> None:
        super().__init__()
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        from transformers import AutoTokenizer

        # a pass's token budget: every decoding request's token, and at least one prompt token
        self.model_id, self.max_concurrent = model_id, max_concurrent
        self.prefill_chunk = max(prefill_chunk, max_concurrent + 1)
        self.model = PagedModel(Path(model_path), device, precision, progress)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model.model_dir)
        except Exception as e:
            self.model.close()
            raise EngineError(f"cannot load the tokenizer of {model_path}: {e}") from e
        # the pool: room for every request at the full context, at most kv_budget_bytes; one
        # request must fit it whole, so the context is capped by it
        context = engine_context(self.model.model_dir, context_length)
        blocks = min(max_concurrent * -(-context // self.model.block_size),
                     max(1, kv_budget_bytes // self.model.block_bytes), max_blocks or 1 << 40)
        self.model.allocate(blocks)
        self.pool = BlockPool(self.model.blocks, self.model.block_size, keep=prompt_cache)
        self.context_length = min(context, self.model.blocks * self.model.block_size)
        self.eos_ids = eos_token_ids(self.model.model_dir, self.tokenizer)
        from engine.speculative.local import LocalSpeculation
        from engine.speculative.config import SpecConfig

        try:  # speculation defaults; a request's `speculative` field overrides them
            self.spec = LocalSpeculation(speculative or SpecConfig(), self.model, model_id, self.model.vocab,
                                         device, precision, progress)
        except Exception as e:
            self.model.close()
            raise EngineError(f"cannot start speculative decoding: {e}") from e
        self._admitted = 0
        self._later: list[TokenEvent] = []  # this pass's events, sent once the next has started (_turn)
        self.preemptions = 0  # requests that gave their blocks back to let an earlier one grow
        self._start_scheduler(f"flotilla-paged-{model_id}")

    @classmethod
    def from_spec(cls, spec: str, progress: Progress | None = None, **kw: Any) -> "PagedEngine":
        from engine.models import resolve_model

        resolved = resolve_model(spec, progress)
        return cls(Path(resolved.path), resolved.model_id, progress=progress, **kw)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.model_id, "local", self.model.device, self.context_length,
                          tool_format.of(self.tokenizer).name)

    def set_prompt_cache(self, streams: int) -> None:
        """Prompt caching on (streams > 0) or off; its size is bounded by the pool, not a count."""
        with self._lock:
            self.pool.set_keep(streams > 0)

    def _shutdown(self) -> None:
        self._stop_scheduler()
        self.spec.close()
        self.model.close()

    # -- the scheduler thread (TurnEngine._run) ------------------------------------
    def _admit(self, request: GenerateRequest, t_submit: float) -> Generation | None:
        """Template the prompt, take over cached blocks; a bad request ends here."""
        seq = None
        try:
            ids = request_ids(self.tokenizer, request)
            with self._lock:
                shared = self.pool.match(ids) if len(ids) < self.context_length else []
            cached = len(shared) * self.pool.block_size
            self._admitted += 1
            seq = PagedSeq(self.pool, shared, list(ids[:cached]), list(ids[cached:]), cached, self._admitted)
            gen = Generation.create(request, ids, seq, self.tokenizer, self.eos_ids, self.context_length,
                                    self.prefill_chunk, t_submit)
            if self.spec.wants(request):
                self.spec.open(request, gen)
            return gen
        except Exception as e:
            if seq is not None:
                with self._lock:
                    seq.close()
            self._emit(TokenEvent(request.request_id, finish_reason="error", error=one_line(e),
                                  error_code=error_code_of(e), usage=Usage(0, 0)))
            return None

    def _turn(self, active: list[Generation]) -> list[Generation]:
        """One forward pass for every running request, then the picks of those it gave logits.

        The events a pass gives are sent once the next pass has started (`_later`): sending
        one wakes the API's thread, which then holds the GIL while it writes the answers'
        chunks, and a scheduler thread waiting for the GIL between two passes leaves the
        CPU idle meanwhile (timed by hand behind the API at one request: the gap between two
        passes got smaller). A turn after which nothing runs sends them at once."""
        batch = self._plan(active)
        if not batch:
            self._flush()
            return []
        try:
            self.model.start([w for _g, w in batch])
            self._flush()  # the last pass's events, while this one computes
            rows = self.model.result()
        except Exception as e:  # the pass failed: every request in it ends with the error
            log.exception("paged forward pass failed")
            for gen, _w in batch:  # _end sends the held events first
                self._end(gen, finished(gen, "error", error=one_line(e)))
            return [g for g, _w in batch]
        ended, row = [], 0
        for gen, work in batch:
            got, row = rows[row:row + work.logits], row + work.logits
            try:
                event = self._take(gen, work, got)
            except Exception as e:
                log.exception("request %s failed", gen.request_id)
                event = finished(gen, "error", error=one_line(e))
            if event is None:
                continue
            if event.final:
                self._close(gen)
                ended.append(gen)
            self._later.append(event)
        if len(ended) == len(active):  # no next pass to send them behind
            self._flush()
        return ended

    def _flush(self) -> None:
        """Send the events held back for the next pass (in the order they were made)."""
        events, self._later = self._later, []
        for event in events:
            self._emit(event)

    def _take(self, gen: Generation, work: SeqWork, rows: Any) -> TokenEvent | None:
        """What one request's part of the pass gives: nothing yet (a prompt chunk), its next
        token (one logits row), or a verify step's tokens (a speculating request's rows)."""
        seq: PagedSeq = gen.stream
        seq.fed.extend(work.ids)
        session = self.spec.session(gen)
        if session is not None and gen.pending is not None and not seq.todo:  # [pending, d1..dk] verified
            if session.needs_logits:
                tokens = session.verify(logits=rows)
            else:
                tokens = session.verify(target_tokens=rows.argmax(axis=-1).tolist())
            del seq.fed[len(seq.fed) - session.rejected:]  # rollback: the rejected drafts' KV is overwritten later
            gen.pending = None
            return emit_tokens(gen, tokens)
        del seq.todo[:len(work.ids)]
        gen.prefilled = min(len(gen.prompt_ids), seq.past)
        if not work.logits:
            return None
        event = accept(gen, pick(gen, rows[0]), rows[0])
        if not event.final and session is None:
            seq.todo.append(gen.pending)  # fed in the next pass
            gen.pending = None
        return event

    def _plan(self, active: list[Generation]) -> list[tuple[Generation, SeqWork]]:
        """This turn's work: every decoding request's token (or verify step), then prompt
        chunks in admission order while the token budget lasts; blocks for all of it
        (preempting later requests if need be)."""
        order = sorted(active, key=lambda g: (len(g.stream.todo) > 1, g.stream.admitted))
        budget, batch, planned = self.prefill_chunk, [], set()
        with self._lock:
            for gen in order:
                seq: PagedSeq = gen.stream
                if seq.closed or budget <= 0:
                    continue
                if seq.todo:  # a prompt (or, after preemption, everything so far) or the last pick
                    ids = seq.todo[:budget]
                    # logits when this drains it, unless the next token is already picked (a speculating
                    # request fed again after preemption: its next step is a verify step)
                    rows = int(len(ids) == len(seq.todo) and gen.pending is None)
                elif gen.pending is not None and (session := self.spec.session(gen)) is not None:
                    ids = session.draft()  # [pending, d1..dk]
                    rows = len(ids)
                else:
                    continue
                if not self._grow(seq, seq.past + len(ids), active, planned):
                    continue  # no blocks even after preempting: waits for a later turn
                budget -= len(ids)
                if gen.t_start is None:
                    gen.t_start = time.perf_counter()
                planned.add(id(gen))
                batch.append((gen, SeqWork(ids, seq.past, list(seq.blocks), rows)))
        return batch

    def _grow(self, seq: PagedSeq, positions: int, active: list[Generation], planned: set[int]) -> bool:
        """Blocks for `positions` in seq; when the pool is dry, preempt requests admitted
        after it that are not in this turn's pass (`planned`: their ids)."""
        need = self.pool.blocks_for(positions) - len(seq.blocks)
        while True:
            got = self.pool.allocate(need)
            if got is not None:
                seq.blocks.extend(got)
                return True
            victims = [g.stream for g in active if id(g) not in planned and g.stream is not seq
                       and g.stream.blocks and g.stream.admitted > seq.admitted]
            if not victims:
                return False
            max(victims, key=lambda s: s.admitted).preempt()
            self.preemptions += 1

    def _close(self, gen: Generation) -> None:
        """Free a request's blocks (they stay in the pool for prompt caching)."""
        try:
            self.spec.end(gen)
        finally:
            with self._lock:
                gen.stream.close()

    def _end(self, gen: Generation, event: TokenEvent) -> None:
        """End a request from outside a pass (cancelled, the engine closing, a failed pass):
        after the events held back, so a request's events keep their order."""
        try:
            self._close(gen)
        finally:
            self._flush()
            self._emit(event)
