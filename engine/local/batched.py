"""BatchedEngine: one model on this machine, concurrent requests in one forward pass.

openvino_genai's ContinuousBatchingPipeline computes every running request's
next token in one batched inference over a paged KV cache (and splits long
prompts into chunks it fuses with the others' decode steps). It runs in a child
process (engine/local/batched_worker.py has why: its step() holds the GIL); this
engine is a scheduler thread that sends it prompt ids and reads back token ids.
The pipeline picks the tokens; everything after the pick is Flotilla's own: the
prompt ids come from request_ids (the chat template, tools), and each token goes
through generation.accept (text, EOS, stop strings, the length limit, usage and
timings), so an answer ends the way it does on the local engine and the API
cannot tell the two apart.

What the pipeline cannot do is refused before the request runs (EngineInfo.unsupported,
a 400 naming the field at the API): top_logprobs (it reports the chosen token's
logprob only), a JSON schema or forced tool call (its grammar engine is xgrammar,
not the llguidance grammar the other engines enforce), speculative decoding.
"""

from __future__ import annotations

import itertools
import logging
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.platform import process
from engine.protocol.errors import one_line
from engine.protocol.messages import GenerateRequest, SamplingParams, TokenEvent, Usage
from engine.runtime.backend import Progress
from engine.runtime.chat import request_ids
from engine.runtime.detokenize import eos_token_ids
from engine.runtime.errors import RequestError, error_code_of
from engine.runtime.generation import Generation, accept, finished
from engine.runtime import tool_format
from engine.local import batched_worker
from engine.core.refusal import engine_refusal
from engine.core.interface import Engine, EngineError, EngineInfo
from engine.scheduler.inbox import TurnEngine
from engine.models.profile import engine_context

log = logging.getLogger(__name__)

KV_CACHE_GB = 2  # the paged KV cache's size; the pipeline refuses requests beyond it (IGNORED)
UNSUPPORTED = frozenset({"top_logprobs", "response_format", "tool_choice", "speculative"})
TICK_S = 0.05  # longest wait for the pipeline's next step before new requests are looked at
START_TIMEOUT_S = 900.0  # compiling a large model on a slow PC


def generation_config(sampling: SamplingParams, max_new: int, eos_ids: frozenset[int]) -> dict[str, Any]:
    """The pipeline's GenerationConfig fields for one request. EOS and stop strings are
    decided by accept() (the pipeline stops at the EOS ids too, so it does not run past them)."""
    cfg: dict[str, Any] = {"max_new_tokens": max_new, "ignore_eos": sampling.ignore_eos,
                           "do_sample": sampling.temperature > 0,
                           "repetition_penalty": sampling.repetition_penalty}
    if not sampling.ignore_eos and eos_ids:
        cfg["stop_token_ids"] = sorted(eos_ids)
    if cfg["do_sample"]:
        cfg.update(temperature=sampling.temperature, top_p=sampling.top_p)
        if sampling.top_k:
            cfg["top_k"] = sampling.top_k
        if sampling.seed is not None:
            cfg["rng_seed"] = sampling.seed
    if sampling.logprobs is not None:
        cfg["logprobs"] = 1
    return cfg


class PipelineProcess:
    """The child running the pipeline: start it, send it messages, take its step reports."""

    def __init__(self, folder: Path, device: str, precision: str, max_concurrent: int,
                 kv_cache_gb: float, prefill_chunk: int) -> None:
        argv = [sys.executable, "-m", "engine.local.batched_worker", "--folder", str(folder), "--device", device,
                "--precision", precision, "--max-concurrent", str(max_concurrent),
                "--kv-cache-gb", str(kv_cache_gb), "--prefill-chunk", str(prefill_chunk)]
        self.proc = process.spawn(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, die_with_us=True)
        self._lock = threading.Lock()  # send() comes from the scheduler thread and from close()
        self._reports: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        threading.Thread(target=batched_worker.read_messages, args=(self.proc.stdout.fileno(), self._reports.put),
                         name="batched-reports", daemon=True).start()
        try:
            first = self._reports.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            first = {"op": "failed", "error": f"no answer within {START_TIMEOUT_S:.0f} s"}
        if first is None or first["op"] != "ready":
            self.close()
            why = first["error"] if first else f"it exited with {self.proc.returncode}"
            raise EngineError(f"the batching pipeline did not start: {why}")

    def send(self, message: dict[str, Any]) -> None:
        try:
            with self._lock:
                batched_worker.send(self.proc.stdin, message)
        except (OSError, ValueError) as e:  # a closed pipe: the child is gone
            raise EngineError(self.ended()) from e

    def ended(self) -> str:
        return f"the batching pipeline's process ended (exit {self.proc.poll()})"

    def take(self, timeout: float) -> list[list[Any]] | None:
        """The rows of every step report that arrived (waiting up to timeout for the
        first); None once the child has ended."""
        rows: list[list[Any]] = []
        try:
            report = self._reports.get(timeout=timeout)
            while True:
                if report is None:
                    self._reports.put(None)  # every later take() sees the end too
                    return None
                rows += report["out"]
                report = self._reports.get_nowait()
        except queue.Empty:
            return rows

    def close(self) -> None:
        process.stop(self.proc, 10.0, ask=self.proc.stdin.close)


@dataclass
class _Handle:
    """A request's place in the pipeline: what Generation.stream holds on this engine."""

    rid: int
    child: PipelineProcess | None  # None once the pipeline has ended the request
    cached: int = 0  # the pipeline does not say how much of the prompt its prefix cache held

    def close(self) -> None:
        if self.child is not None:  # still running there: ask the pipeline to drop it
            try:
                self.child.send({"op": "cancel", "id": self.rid})
            except EngineError:
                pass  # the child is gone, and the request with it
        self.child = None


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

        self.model_id, self.device, self.max_concurrent = model_id, device, max_concurrent
        ir = ensure_ir(Path(model_path), progress=progress)
        try:
            folder = genai_folder(ir)
            self.tokenizer = AutoTokenizer.from_pretrained(ir)
        except Exception as e:
            raise EngineError(f"cannot open {model_id} on openvino_genai's batching pipeline: {e}") from e
        if progress:
            progress(f"compiling {model_id} for the batching pipeline")
        self._child = PipelineProcess(folder, device, precision, max_concurrent, kv_cache_gb, prefill_chunk)
        self.context_length = engine_context(ir, context_length)
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
        self._child.close()

    # -- the scheduler thread (TurnEngine._run) ------------------------------------
    def _turn(self, active: list[Generation]) -> list[Generation]:
        if not active:
            return []
        rows = self._child.take(TICK_S)
        if rows is None:  # the pipeline's process ended under us
            why = self._child.ended()
            for gen in active:
                gen.stream.child = None
                self._end(gen, finished(gen, "error", error=why))
            return list(active)
        by_rid = {gen.stream.rid: gen for gen in active}  # an ended request's late rows find none
        ended = []
        for rid, ids, lps, status, error in rows:
            gen = by_rid.get(rid)
            if gen is not None and self._apply(gen, ids, lps, status, error):
                ended.append(by_rid.pop(rid))
        return ended

    def _apply(self, gen: Generation, ids: list[int], lps: list[float], status: str, error: str | None) -> bool:
        """Feed one request's new tokens through accept(); True when it ended."""
        if status != "running":
            gen.stream.child = None  # the pipeline is done with it: nothing to cancel there
        want_lp = gen.request.sampling.logprobs is not None
        for i, token in enumerate(ids):
            event = accept(gen, int(token), logprob=lps[i] if want_lp and i < len(lps) else None)
            if event.final:
                self._end(gen, event)
                return True
            self._emit(event)
        if status == "running":
            return False
        if status in ("error", "ignored"):
            why = error if status == "error" else "the pipeline's KV cache cannot hold this request"
            self._end(gen, finished(gen, "error", error=why))
        else:  # finished by the pipeline at a token accept() did not end on (its own EOS list)
            self._end(gen, finished(gen, "length" if len(gen.output_ids) >= gen.max_new else "stop",
                                    gen.detok.finish()))
        return True

    def _admit(self, request: GenerateRequest, t_submit: float) -> Generation | None:
        """Template the prompt and hand it to the pipeline; a bad request ends here."""
        try:
            refused = engine_refusal(request, UNSUPPORTED)
            if refused is not None:  # the API refuses these before submitting; other callers end here
                raise RequestError(f"{refused.param} is not supported by the batched engine")
            ids = request_ids(self.tokenizer, request)
            rid = next(self._ids)
            gen = Generation.create(request, ids, _Handle(rid, self._child), self.tokenizer, self.eos_ids,
                                    self.context_length, t_submit=t_submit)
            cfg = generation_config(request.sampling, gen.max_new, frozenset() if request.sampling.ignore_eos
                                    else self.eos_ids)
            self._child.send({"op": "add", "id": rid, "ids": [int(i) for i in ids], "config": cfg})
            gen.t_start = time.perf_counter()
            return gen
        except Exception as e:
            self._emit(TokenEvent(request.request_id, finish_reason="error", error=one_line(e),
                                  error_code=error_code_of(e), usage=Usage(0, 0)))
            return None

    def _end(self, gen: Generation, event: TokenEvent) -> None:
        try:
            gen.stream.close()
        finally:
            self._emit(event)


def open_batched(spec: str, options: Any, progress: Progress | None) -> Engine:
    """engine kind "batched" (engine/local/factory.py)."""
    return BatchedEngine.from_spec(spec, device=options.device, precision=options.precision, progress=progress,
                                   max_concurrent=int(options.extra.get("max_concurrent", 8)),
                                   context_length=options.extra.get("context_length"))
