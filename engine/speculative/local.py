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
from typing import Any, Sequence

import numpy as np

from engine.protocol.messages import GenerateRequest, TokenEvent
from engine.runtime.generation import Generation, decode_one, prefill_step
from engine.speculative.config import SpecConfig
from engine.runtime.stateful_stream import StatefulStream
from engine.speculative.session import SpecSession, emit_tokens
from engine.speculative.speculation import Speculation

log = logging.getLogger(__name__)


class MaskedOVStream:
    """One request's KV state with mask-based rollback (an OpenVINO stateful IR)."""

    def __init__(self, compiled: Any, input_names: set[str], chunk: int,
                 compact_fraction: float, compact_min_hidden: int) -> None:
        missing = {"attention_mask", "position_ids"} - input_names
        if missing:
            raise ValueError(f"speculation needs model inputs {sorted(missing)}")
        self.state = StatefulStream(compiled.create_infer_request(), input_names)
        self.state.reset()
        self.chunk = chunk
        self.compact_fraction = compact_fraction
        self.compact_min_hidden = compact_min_hidden

    @property
    def past(self) -> int:
        return self.state.visible

    @property
    def compactions(self) -> int:
        return self.state.compactions

    def run(self, ids: Sequence[int]) -> np.ndarray:
        """Append ids (visible); logits of every position, float32 [n, V] (a copy)."""
        arr = np.asarray(ids, dtype=np.int64).reshape(1, -1)  # [1, n]
        self.state.infer({"input_ids": arr}, arr.shape[1])
        return np.array(self.state.request.get_tensor("logits").data[0], dtype=np.float32)

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
        self.state.hide_tail(count)
        self.state.compact_if(self.compact_fraction, self.compact_min_hidden)

    def close(self) -> None:
        self.state = None


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


class LocalSpeculation(Speculation):
    """The local engines' speculation (engine/speculative/speculation.py): a masked stream per
    speculating request and its session, by request."""

    def __init__(self, config: SpecConfig, backend: Any, model_id: str, vocab: int,
                 device: str = "CPU", precision: str = "default", progress: Any = None) -> None:
        self.backend = backend
        self.sessions: dict[int, SpecSession] = {}  # id(gen) -> session
        super().__init__(config, model_id, vocab, device, precision, progress)

    @property
    def supported(self) -> bool:
        return hasattr(self.backend, "compiled") and hasattr(self.backend, "input_names")

    def new_stream(self, request: GenerateRequest) -> MaskedOVStream | None:
        """A masked stream when the request speculates, else None (the plain one is used)."""
        if not self.wants(request):
            return None
        if not self.supported:
            raise ValueError("speculative decoding needs the openvino backend")
        return MaskedOVStream(self.backend.compiled, self.backend.input_names, self.backend.chunk,
                              self.config.compact_fraction, self.config.compact_min_hidden)

    def open(self, request: GenerateRequest, gen: Generation) -> SpecSession | None:
        session = self.new_session(request, gen)
        if session is not None:
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
        super().close()
