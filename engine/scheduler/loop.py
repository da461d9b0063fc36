"""LocalEngine: one model on this machine (OpenVINO, or the torch reference).

One scheduler thread serves every request round-robin: each turn it admits
new requests (up to max_concurrent; their prompts are prefilled chunk by
chunk as their turns come = continuous admission), then gives every active
request one step (a prefill chunk or one token). Each request has its own KV
state, so answers do not depend on what else runs. A failure in one request
ends that request with an error event; the thread goes on.

Speculative decoding (engine/speculative/local.py): a request whose
`speculative` field (or the engine's default, `speculative=SpecConfig(...)`)
asks for it gets a mask-rollback stream, and each of its steps verifies
1..k drafted tokens at once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from engine.protocol.messages import GenerateRequest, TokenEvent, Usage
from engine.runtime.backend import BACKENDS, ModelBackend, Progress, load_backend
from engine.runtime.chat import request_ids
from engine.models.profile import engine_context
from engine.runtime.detokenize import eos_token_ids
from engine.runtime.errors import error_code_of, one_line
from engine.runtime.generation import Generation, finished, step
from engine.speculative.local import MaskedOVStream, spec_step
from engine.scheduler.inbox import TurnEngine
from engine.core.interface import EngineError, EngineInfo
from engine.runtime import tool_format

log = logging.getLogger(__name__)

class BackendLoop(TurnEngine):
    """The round-robin loop over a loaded ModelBackend: each turn, one unit of work per
    running request (a prefill chunk, a token, or a speculation verify step). A subclass
    opens the backend and hands it over; if this constructor fails, it closes the backend.

    spec_factory(tokenizer) makes the speculation hooks (open/session/end/close); KIND is
    what EngineInfo.engine says."""

    KIND = "local"

    def __init__(self, backend: ModelBackend, model_id: str, context_length: int, max_concurrent: int,
                 prefill_chunk: int, spec_factory: Callable[[Any], Any]) -> None:
        super().__init__()
        from transformers import AutoTokenizer

        self.model_id = model_id
        self.backend = backend
        try:
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(backend.model_dir)
            except Exception as e:
                raise EngineError(f"cannot load the tokenizer of {backend.model_dir}: {e}") from e
            self.context_length = context_length
            self.eos_ids = eos_token_ids(backend.model_dir, self.tokenizer)
            self.max_concurrent = max_concurrent
            self.prefill_chunk = prefill_chunk
            try:  # speculation defaults; a request's `speculative` field overrides them
                self.spec = spec_factory(self.tokenizer)
            except Exception as e:
                raise EngineError(f"cannot start speculative decoding: {e}") from e
        except BaseException:
            backend.close()
            raise
        self._start_scheduler(f"flotilla-{self.KIND}-{model_id}")

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.model_id, self.KIND, self.backend.device, self.context_length,
                          tool_format.of(self.tokenizer).name)


    def set_prompt_cache(self, streams: int) -> None:
        """Keep at most this many finished streams' KV for follow-up prompts (0: none);
        a backend without a prompt cache (the torch reference) has nothing to set."""
        setter = getattr(self.backend, "set_prompt_cache", None)
        if setter is not None:
            setter(streams)

    # -- Engine hooks ------------------------------------------------------------
    def _shutdown(self) -> None:
        self._stop_scheduler()
        self.spec.close()
        self.backend.close()

    # -- the scheduler thread (TurnEngine._run) ------------------------------------
    def _turn(self, active: list[Generation]) -> list[Generation]:
        ended = []
        for gen in list(active):
            if self._stop.is_set():
                break
            if self._step(gen):
                ended.append(gen)
        return ended

    def _admit(self, request: GenerateRequest, t_submit: float) -> Generation | None:
        """Tokenize and open a stream; a bad request ends here with an error event."""
        stream = None
        try:
            ids = request_ids(self.tokenizer, request)
            stream = self.spec.new_stream(request) or self.backend.new_stream(ids)
            gen = Generation.create(request, ids, stream, self.tokenizer, self.eos_ids,
                                    self.context_length, self.prefill_chunk, t_submit)
            if isinstance(stream, MaskedOVStream):
                self.spec.open(request, gen)
            return gen
        except Exception as e:
            if stream is not None:
                stream.close()
            self._emit(TokenEvent(request.request_id, finish_reason="error", error=one_line(e),
                                  error_code=error_code_of(e), usage=Usage(0, 0)))
            return None

    def _step(self, gen: Generation) -> bool:
        """Advance one request; True when it ended."""
        try:
            session = self.spec.session(gen)
            event = spec_step(gen, session) if session is not None else step(gen)
        except Exception as e:
            log.exception("request %s failed", gen.request_id)
            self._end(gen, finished(gen, "error", error=one_line(e)))
            return True
        if event is None:
            return False
        if event.final:
            self._end(gen, event)
            return True
        self._emit(event)
        return False

    def _end(self, gen: Generation, event: TokenEvent) -> None:
        try:
            self.spec.end(gen)
            gen.stream.close()
        finally:
            self._emit(event)


class LocalEngine(BackendLoop):
    """`--engine loop`: one model on this machine (OpenVINO, or the torch reference), each
    request on its own InferRequest and KV state."""

    def __init__(self, model_path: Path, model_id: str, device: str = "CPU", precision: str = "default",
                 backend: str = "openvino", max_concurrent: int = 8, context_length: int | None = None,
                 progress: Progress | None = None, prefill_chunk: int = 512,
                 speculative: Any = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        loaded: ModelBackend = load_backend(backend, Path(model_path), device, precision, progress)

        def speculation(tokenizer: Any) -> Any:
            from engine.speculative.config import SpecConfig
            from engine.speculative.local import LocalSpeculation

            return LocalSpeculation(speculative or SpecConfig(), loaded, model_id,
                                    _logits_width(loaded, len(tokenizer)), device, precision, progress)

        super().__init__(loaded, model_id, engine_context(loaded.model_dir, context_length), max_concurrent,
                         prefill_chunk, speculation)

    @classmethod
    def from_spec(cls, spec: str, progress: Progress | None = None, **kw: Any) -> "LocalEngine":
        """Resolve a model spec ("demo", a folder, a hub id...) and open it."""
        from engine.models import resolve_model

        resolved = resolve_model(spec, progress)
        return cls(Path(resolved.path), resolved.model_id, progress=progress, **kw)


def _logits_width(backend: Any, fallback: int) -> int:
    """The vocabulary width of the model's logits (may exceed the tokenizer's)."""
    try:
        return int(backend.compiled.output("logits").get_partial_shape()[2].get_length())
    except Exception:
        return fallback
