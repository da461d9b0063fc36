"""openvino_genai's LLMPipeline behind the Engine interface: a baseline for `bench serve`.

LLMPipeline answers one request at a time (generate() holds the pipeline until the
answer ends), so this engine runs the waiting requests one after the other on its
scheduler thread -- what an app built straight on LLMPipeline gives several users.
The pipeline picks the tokens (greedy or its own sampler); each goes through
generation.accept, as on the batched engine, so the API cannot tell the engines
apart and the bench compares scheduling, not text handling. It is not an engine kind
users pick: the local and batched engines do everything it does.
"""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path
from typing import Any

from engine.protocol.errors import one_line
from engine.protocol.messages import GenerateRequest, TokenEvent, Usage
from engine.runtime import tool_format
from engine.runtime.backend import Progress
from engine.runtime.chat import request_ids
from engine.runtime.detokenize import eos_token_ids
from engine.runtime.generation import Generation, accept, finished
from engine.local.batched import UNSUPPORTED as BATCHED_UNSUPPORTED
from engine.local.batched import generation_config
from engine.local.batched_worker import generation_config as genai_config
from engine.core.refusal import engine_refusal
from engine.scheduler.inbox import InboxEngine, refuse_waiting
from engine.core.interface import EngineError, EngineInfo
from engine.models.profile import engine_context

log = logging.getLogger(__name__)

UNSUPPORTED = BATCHED_UNSUPPORTED | {"logprobs"}  # its streamer hands over token ids only


class LLMPipelineEngine(InboxEngine):
    def __init__(self, model_path: Path, model_id: str, device: str = "CPU", precision: str = "default",
                 progress: Progress | None = None) -> None:
        super().__init__()
        from transformers import AutoTokenizer

        from engine.runtime.genai_folder import genai_folder
        from engine.runtime.ov_backend import ensure_ir
        from engine.runtime.ov_compile import compile_config

        self.model_id, self.device, self.max_concurrent = model_id, device, 1
        ir = ensure_ir(Path(model_path), progress=progress)
        try:
            import openvino_genai as ov_genai

            self.tokenizer = AutoTokenizer.from_pretrained(ir)
            self.pipe = ov_genai.LLMPipeline(str(genai_folder(ir)), device, **compile_config(device, precision))
        except Exception as e:
            raise EngineError(f"cannot open {model_id} on openvino_genai's LLMPipeline: {e}") from e
        self.context_length = engine_context(ir)
        self.eos_ids = eos_token_ids(ir, self.tokenizer)
        # One streamer for the engine's life, dropped after the pipeline: the pipeline may keep
        # the last streamer it was given, and a Python streamer freed before it is a dangling
        # pointer when the pipeline is destroyed later.
        self._write: Any = None  # the running request's token handler
        self._streamer = _Streamer(lambda token: self._write(token))
        self._start_scheduler(f"flotilla-llm-pipeline-{model_id}")

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.model_id, "llm-pipeline", self.device, self.context_length,
                          tool_format.of(self.tokenizer).name, unsupported=UNSUPPORTED)

    def _shutdown(self) -> None:
        self._stop_scheduler()
        del self.pipe
        del self._streamer

    def _run(self) -> None:
        waiting: collections.deque[tuple[GenerateRequest, float]] = collections.deque()
        while not self._stop.is_set():
            try:
                self._take_inbox(waiting, block=not waiting)
                self._take_cancelled(waiting, ())
                if waiting:
                    self._serve(*waiting.popleft())
            except Exception:  # a bug in the loop itself: log, keep serving
                log.exception("llm-pipeline scheduler error")
        self._take_inbox(waiting, block=False)
        refuse_waiting(self._emit, waiting)

    def _serve(self, request: GenerateRequest, t_submit: float) -> None:
        """One whole answer: generate() calls the streamer with each token."""
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        try:
            refused = engine_refusal(request, UNSUPPORTED)
            if refused is not None:  # the API refuses these before submitting; other callers end here
                raise ValueError(f"{refused.param} is not supported by the llm-pipeline engine")
            ids = request_ids(self.tokenizer, request)
            gen = Generation.create(request, ids, None, self.tokenizer, self.eos_ids,  # type: ignore[arg-type]
                                    self.context_length, t_submit=t_submit)
        except Exception as e:
            self._emit(TokenEvent(request.request_id, finish_reason="error", error=one_line(e), usage=Usage(0, 0)))
            return
        ended = False

        def write(token: int | list[int]) -> Any:
            nonlocal ended
            if self._stop.is_set() or self._take_cancelled(collections.deque(), (gen.request_id,)):
                self._emit(finished(gen, "error" if self._stop.is_set() else "cancelled",
                                    error="the engine was closed" if self._stop.is_set() else None))
                ended = True
                return ov_genai.StreamingStatus.CANCEL
            for t in token if isinstance(token, list) else [token]:
                event = accept(gen, int(t))
                self._emit(event)
                if event.final:
                    ended = True
                    return ov_genai.StreamingStatus.STOP
            return ov_genai.StreamingStatus.RUNNING

        cfg = genai_config(generation_config(request.sampling, gen.max_new,
                                             frozenset() if request.sampling.ignore_eos else self.eos_ids))
        gen.t_start = time.perf_counter()
        self._write = write
        try:
            self.pipe.generate(ov.Tensor(np.array([ids], np.int64)), cfg, self._streamer)
            if not ended:  # the pipeline stopped at a token accept() did not end on (its own EOS list)
                self._emit(finished(gen, "length" if len(gen.output_ids) >= gen.max_new else "stop",
                                    gen.detok.finish()))
        except Exception as e:
            if not ended:
                self._emit(finished(gen, "error", error=one_line(e)))
        finally:
            self._write = None


def _Streamer(write):
    """A StreamerBase whose write() is the given function (end() does nothing)."""
    import openvino_genai as ov_genai

    class Streamer(ov_genai.StreamerBase):
        def write(self, token):
            return write(token)

        def end(self):
            pass

    return Streamer()


def open_llm_pipeline(spec: str, options: Any, progress: Progress | None) -> LLMPipelineEngine:
    """For bench serve: the same resolution and options as the factory's kinds."""
    from engine.models import resolve_model

    resolved = resolve_model(spec, progress)
    return LLMPipelineEngine(Path(resolved.path), resolved.model_id, device=options.device,
                             precision=options.precision, progress=progress)
