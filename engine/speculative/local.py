"""Speculative decoding in LocalEngine: a mask-rollback stream and the step.

`MaskedOVStream` is an OVStream (same prefill/decode) that also runs a
speculative step -- [pending, d1..dk] in one call, logits of every position
-- and hides rejected positions with the attention mask instead of trimming
the KV state (engine/runtime/kv_state.py); it compacts the state when the
hidden share crosses the configured threshold.

`LocalSpeculation` is what LocalEngine owns: it opens a session per request
that asks for speculation and runs its steps; requests without it go through
engine.runtime.generation.step unchanged.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from engine.protocol.messages import GenerateRequest, TokenEvent
from engine.runtime.generation import Generation, decode_one, prefill_step
from engine.speculative.config import SpecConfig, known_draft
from engine.speculative.drafts import DraftModel, LookupDraft
from engine.runtime.kv_state import VisibleMask, compact_state
from engine.speculative.session import SpecSession, emit_tokens

log = logging.getLogger(__name__)


class MaskedOVStream:
    """One request's KV state with mask-based rollback (an OpenVINO stateful IR)."""

    def __init__(self, compiled: Any, input_names: set[str], chunk: int,
                 compact_fraction: float, compact_min_hidden: int) -> None:
        missing = {"attention_mask", "position_ids"} - input_names
        if missing:
            raise ValueError(f"speculation needs model inputs {sorted(missing)}")
        self.req = compiled.create_infer_request()
        self.req.reset_state()
        self.names = input_names
        self.chunk = chunk
        self.mask = VisibleMask()
        self.compact_fraction = compact_fraction
        self.compact_min_hidden = compact_min_hidden
        self.compactions = 0

    @property
    def past(self) -> int:
        return self.mask.visible

    def run(self, ids: Sequence[int]) -> np.ndarray:
        """Append ids (visible); logits of every position, float32 [n, V] (a copy)."""
        arr = np.asarray(ids, dtype=np.int64).reshape(1, -1)  # [1, n]
        n = arr.shape[1]
        feed = {"input_ids": arr, "attention_mask": self.mask.feed(n), "position_ids": self.mask.positions(n)}
        if "beam_idx" in self.names:
            feed["beam_idx"] = np.zeros(1, np.int32)
        self.req.infer(feed)
        self.mask.commit(n)
        return np.array(self.req.get_tensor("logits").data[0], dtype=np.float32)

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        logits = None
        for s in range(0, len(ids), self.chunk):
            logits = self.run(ids[s:s + self.chunk])[-1]
        return logits

    def decode(self, token: int) -> np.ndarray:
        return self.run([token])[-1]

    def hide_tail(self, count: int) -> None:
        """Roll back the last `count` positions: hidden by the mask; compact when due."""
        self.mask.hide_tail(count)
        if self.mask.hidden >= self.compact_min_hidden and self.mask.hidden_fraction >= self.compact_fraction:
            compact_state(self.req, self.mask.keep_index())
            self.mask.compacted()
            self.compactions += 1

    def close(self) -> None:
        self.req = None


def spec_step(gen: Generation, session: SpecSession) -> TokenEvent | None:
    """One unit of a speculating request: a prefill chunk (-> None), the first
    token, or one verify step emitting 1..k+1 tokens."""
    if gen.prefilled < len(gen.prompt_ids):
        prefill_step(gen)
        if gen.logits is None:
            return None
    if gen.logits is not None:  # the first token, from the prefill's logits
        return decode_one(gen)
    stream: MaskedOVStream = gen.stream  # type: ignore[assignment]
    feed = session.draft()  # [pending, d1..dk]
    logits = stream.run(feed)  # [k+1, V]
    if session.needs_logits:
        tokens = session.verify(logits=logits)
    else:
        tokens = session.verify(target_tokens=np.argmax(logits, axis=-1).tolist())
    stream.hide_tail(session.rejected)
    gen.pending = None
    return emit_tokens(gen, tokens)


class LocalSpeculation:
    """LocalEngine's speculation: its defaults, its draft model, its sessions."""

    def __init__(self, config: SpecConfig, backend: Any, model_id: str, vocab: int,
                 device: str = "CPU", precision: str = "default", progress: Any = None) -> None:
        self.config = config
        self.backend = backend
        self.model_id = model_id
        self.vocab = vocab
        self.device = device
        self.precision = precision
        self.progress = progress
        self.draft_model: DraftModel | None = None
        self.sessions: dict[int, SpecSession] = {}  # id(gen) -> session
        if config.mode == "draft":
            self._draft_model()  # load at start, not on the first request

    @property
    def supported(self) -> bool:
        return hasattr(self.backend, "compiled") and hasattr(self.backend, "input_names")

    def _draft_model(self) -> DraftModel:
        if self.draft_model is None:
            spec = self.config.draft_model or known_draft(self.model_id)
            if spec is None:
                raise ValueError(f"no draft model for {self.model_id}: start the engine with --draft-model")
            from engine.models import resolve_model

            path = Path(resolve_model(spec, self.progress).path)
            self.draft_model = DraftModel(path, self.device, self.precision, self.progress)
        return self.draft_model

    def wants(self, request: GenerateRequest) -> bool:
        """Whether a request speculates: its own field, else the engine's default (a request
        held to a grammar or asking logprobs says "off": GenerateRequest sees to that)."""
        return self.config.resolve(request.speculative).on

    def new_stream(self, request: GenerateRequest) -> MaskedOVStream | None:
        """A masked stream when the request speculates, else None (the plain one is used)."""
        if not self.wants(request):
            return None
        if not self.supported:
            raise ValueError("speculative decoding needs the openvino backend")
        return MaskedOVStream(self.backend.compiled, self.backend.input_names, self.backend.chunk,
                              self.config.compact_fraction, self.config.compact_min_hidden)

    def open(self, request: GenerateRequest, gen: Generation) -> SpecSession:
        settings = self.config.resolve(request.speculative)
        if settings.mode == "draft":
            drafter = self._draft_model().new_drafter(self.config.compact_fraction,
                                                      self.config.compact_min_hidden)
        else:
            drafter = LookupDraft(self.config.lookup_max_ngram, self.config.lookup_min_ngram)
        session = SpecSession(gen, drafter, settings, self.vocab)
        self.sessions[id(gen)] = session
        return session

    def session(self, gen: Generation) -> SpecSession | None:
        return self.sessions.get(id(gen))

    def end(self, gen: Generation) -> None:
        s = self.sessions.pop(id(gen), None)
        if s is not None:
            s.close()

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()
        if self.draft_model is not None:
            self.draft_model.close()
