"""BatchedEngine: one model on this machine, concurrent requests in one forward pass.

openvino_genai's ContinuousBatchingPipeline computes every running request's
next token in one batched inference over a paged KV cache (and splits long
prompts into chunks it fuses with the others' decode steps); this engine is a
scheduler thread around it. The pipeline picks the tokens; everything after the
pick is Flotilla's own: the prompt ids come from request_ids (the chat template,
tools), and each token goes through generation.accept (text, EOS, stop strings,
the length limit, usage and timings), so an answer ends the way it does on the
local engine and the API cannot tell the two apart.

What the pipeline cannot do is refused before the request runs (EngineInfo.unsupported,
a 400 naming the field at the API): top_logprobs (it reports the chosen token's
logprob only), a JSON schema or forced tool call (its grammar engine is xgrammar,
not the llguidance grammar the other engines enforce), speculative decoding.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.protocol.errors import one_line
from engine.protocol.messages import GenerateRequest, SamplingParams, TokenEvent, Usage
from engine.runtime.backend import Progress
from engine.runtime.chat import request_ids
from engine.runtime.detokenize import eos_token_ids
from engine.runtime.generation import Generation, accept, finished
from engine.runtime import tool_format
from engine.serve.fields import engine_refusal
from engine.serve.interface import Engine, EngineError, EngineInfo
from engine.serve.inbox import TurnEngine
from engine.serve.local import context_from_config

log = logging.getLogger(__name__)

KV_CACHE_GB = 2  # the paged KV cache's size; the pipeline refuses requests beyond it (IGNORED)
UNSUPPORTED = frozenset({"top_logprobs", "response_format", "tool_choice", "speculative"})


@dataclass
class _Handle:
    """A request's place in the pipeline: what Generation.stream holds on this engine."""

    handle: Any  # openvino_genai GenerationHandle
    cached: int = 0  # the pipeline does not say how much of the prompt its prefix cache held

    def close(self) -> None:
        if self.handle is not None:
            self.handle.cancel()  # a no-op once the pipeline finished the request
        self.handle = None  # no handle outlives the pipeline it came from


def generation_config(sampling: SamplingParams, max_new: int, eos_ids: frozenset[int]) -> Any:
    """The pipeline's GenerationConfig for one request. EOS and stop strings are decided by
    accept() (the pipeline stops at the EOS ids too, so it does not run past them)."""
    import openvino_genai as ov_genai

    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = max_new
    cfg.ignore_eos = sampling.ignore_eos
    if not sampling.ignore_eos and eos_ids:
        cfg.stop_token_ids = set(eos_ids)
    cfg.do_sample = sampling.temperature > 0
    if cfg.do_sample:
        cfg.temperature = sampling.temperature
        cfg.top_p = sampling.top_p
        if sampling.top_k:
            cfg.top_k = sampling.top_k
        if sampling.seed is not None:
            cfg.rng_seed = sampling.seed
    cfg.repetition_penalty = sampling.repetition_penalty
    if sampling.logprobs is not None:
        cfg.logprobs = 1
    return cfg


def scheduler_config(max_concurrent: int, kv_cache_gb: float, chunk: int) -> Any:
    import openvino_genai as ov_genai

    sc = ov_genai.SchedulerConfig()
    sc.cache_size = max(1, int(round(kv_cache_gb)))  # GB
    sc.max_num_seqs = max_concurrent
    sc.max_num_batched_tokens = chunk  # prompt tokens fused into one step with the others' decodes
    sc.dynamic_split_fuse = True
    sc.enable_prefix_caching = True
    return sc


class BatchedEngine(TurnEngine):
    def __init__(self, model_path: Path, model_id: str, device: str = "CPU", precision: str = "default",
                 max_concurrent: int = 8, context_length: int | None = None,
                 progress: Progress | None = None, prefill_chunk: int = 512,
                 kv_cache_gb: float = KV_CACHE_GB) -> None:
        super().__init__()
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        from transformers import AutoTokenizer

        from engine.runtime.genai_folder import genai_folder
        from engine.runtime.ov_backend import ensure_ir
        from engine.runtime.ov_compile import compile_config

        self.model_id, self.device, self.max_concurrent = model_id, device, max_concurrent
        ir = ensure_ir(Path(model_path), progress=progress)
        try:
            import openvino_genai as ov_genai

            folder = genai_folder(ir)
            self.tokenizer = AutoTokenizer.from_pretrained(ir)
            self.pipe = ov_genai.ContinuousBatchingPipeline(
                str(folder), scheduler_config(max_concurrent, kv_cache_gb, prefill_chunk), device,
                compile_config(device, precision))
        except Exception as e:
            raise EngineError(f"cannot open {model_id} on openvino_genai's batching pipeline: {e}") from e
        trained = context_from_config(ir)
        self.context_length = min(context_length, trained) if context_length else trained
        self.eos_ids = eos_token_ids(ir, self.tokenizer)
        self._ids = itertools.count()
        self._start_scheduler(f"flotilla-batched-{model_id}")

    @classmethod
    def from_spec(cls, spec: str, progress: Progress | None = None, **kw: Any) -> "BatchedEngine":
        from engine.models import resolve_model

        resolved = resolve_model(spec, progress)
        return cls(Path(resolved.path), resolved.model_id, progress=progress, **kw)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.model_id, "batched", self.device, self.context_length,
                          tool_format.of(self.tokenizer).name, unsupported=UNSUPPORTED)

    def _shutdown(self) -> None:
        self._stop_scheduler()
        del self.pipe

    # -- the scheduler thread (TurnEngine._run) ------------------------------------
    def _turn(self, active: list[Generation]) -> list[Generation]:
        if active:
            self.pipe.step()  # one batched forward: a token for every running request
        return [gen for gen in list(active) if self._read(gen)]

    def _admit(self, request: GenerateRequest, t_submit: float) -> Generation | None:
        """Template the prompt and hand it to the pipeline; a bad request ends here."""
        import numpy as np
        import openvino as ov

        try:
            refused = engine_refusal(request, UNSUPPORTED)
            if refused is not None:  # the API refuses these before submitting; other callers end here
                raise ValueError(f"{refused.param} is not supported by the batched engine")
            ids = request_ids(self.tokenizer, request)
            gen = Generation.create(request, ids, _Handle(None), self.tokenizer, self.eos_ids,
                                    self.context_length, t_submit=t_submit)
            cfg = generation_config(request.sampling, gen.max_new, frozenset() if request.sampling.ignore_eos
                                    else self.eos_ids)
            gen.stream = _Handle(self.pipe.add_request(next(self._ids), ov.Tensor(np.array([ids], np.int64)), cfg))
            gen.t_start = time.perf_counter()
            return gen
        except Exception as e:
            self._emit(TokenEvent(request.request_id, finish_reason="error", error=one_line(e), usage=Usage(0, 0)))
            return None

    def _read(self, gen: Generation) -> bool:
        """Take the tokens the pipeline made for this request; True when it ended."""
        import openvino_genai as ov_genai

        handle = gen.stream.handle
        try:
            if handle.can_read():
                for out in handle.read().values():  # one sequence per request (no beams, n = 1)
                    lps = list(out.generated_log_probs) if gen.request.sampling.logprobs is not None else []
                    for i, token in enumerate(out.generated_ids):
                        event = accept(gen, int(token), logprob=lps[i] if i < len(lps) else None)
                        if event.final:
                            self._end(gen, event)
                            return True
                        self._emit(event)
            status = handle.get_status()
            if status == ov_genai.GenerationStatus.RUNNING:
                return False
            if status == ov_genai.GenerationStatus.IGNORED:
                raise RuntimeError("the pipeline's KV cache cannot hold this request")
            # finished by the pipeline at a token accept() did not end on (its own EOS list)
            self._end(gen, finished(gen, "length" if len(gen.output_ids) >= gen.max_new else "stop",
                                    gen.detok.finish()))
            return True
        except Exception as e:
            log.exception("request %s failed", gen.request_id)
            self._end(gen, finished(gen, "error", error=one_line(e)))
            return True

    def _end(self, gen: Generation, event: TokenEvent) -> None:
        try:
            gen.stream.close()
        finally:
            self._emit(event)


def open_batched(spec: str, options: Any, progress: Progress | None) -> Engine:
    """engine kind "batched" (engine/serve/factory.py)."""
    return BatchedEngine.from_spec(spec, device=options.device, precision=options.precision, progress=progress,
                                   max_concurrent=int(options.extra.get("max_concurrent", 8)))
