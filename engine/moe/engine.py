"""MoEEngine: an MoE model whose experts live on disk, behind the Engine interface.

One scheduler thread owns the model: each turn it admits new requests
(continuous admission, up to max_concurrent), drops cancelled ones and lets
the scheduler (Bevy or a baseline, see scheduler.py) do a round of work.
Fetch threads read experts meanwhile. Token picking, detokenizing, stop
strings and timings are engine.runtime's (the same as LocalEngine).

Prompt caching: a request's KV slot keeps what it held when the answer ended, and a
new prompt that starts the same way takes that slot and prefills only the rest
(model.KVPool; usage reports what it took over as cached_tokens). On this engine
that saves more than compute: every prefill chunk needs nearly all of a layer's
experts, read from disk.

    engine = MoEEngine.from_spec("demo-moe", MoEConfig(scheduler="bevy", cache_budget_bytes=2**20))
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from engine.moe.cache import BudgetError, ExpertCache, plan_budget, working_bytes
from engine.moe.convert import ensure_store
from engine.moe.fetcher import Fetcher
from engine.moe.model import MoEModel
from engine.moe.scheduler import ABLATIONS, SCHEDULERS, Seq, make_scheduler
from engine.moe.store import ExpertStore, StoreConfig, StoreError
from engine.models.profile import engine_context  # KV reserved per request: asked, or the one default
from engine.platform.memory import memory_room
from engine.protocol.messages import GenerateRequest, TokenEvent, Usage
from engine.runtime.chat import request_ids
from engine.runtime.detokenize import eos_token_ids
from engine.runtime.errors import error_code_of, one_line
from engine.runtime.generation import Generation, decode_one, finished
from engine.runtime import widen_kernel
from engine.runtime.stored import ALL_ROWS, STORAGE_DTYPES, native_rows
from engine.runtime.torch_kv import KV_DTYPES, asked_kv_precision
from engine.core.interface import EngineError, EngineInfo
from engine.scheduler.inbox import InboxEngine, refuse_waiting, step_failed
from engine.runtime import tool_format

log = logging.getLogger(__name__)

Progress = Callable[[str, float], None]


@dataclass(frozen=True)
class MoEConfig:
    scheduler: str = "bevy"  # "bevy", or a baseline: "on_demand", "prefetch", "resident" (ablations: ABLATIONS)
    cache_budget_bytes: int | None = None  # RAM for cached experts; None = what is left once weights and KV are in
    weights: str | None = None  # None: the checkpoint's dtype (bf16 stays bf16); "int8": quantized per row
    kv_precision: str = "f16"  # KV cache dtype: "f16" (16-bit) or "f32" (exact, for equivalence tests)
    fetch_threads: int = 4  # parallel blob reads (keeps the disk queue full)
    direct_io: bool = True  # O_DIRECT reads, so figures show the disk, not the page cache
    verify: str = "first"  # checksum each blob's "first" read and again after its file changed
    #                        (engine/platform/read_checks.py), "always" (every read), "never"
    max_concurrent: int = 4  # requests in flight (each reserves a full context of KV); more wait in line
    prefill_chunk: int = 256  # prompt tokens per pass
    # None: every core. The readers wait on the disk, not the CPU: side by side on a 2-core PC (bench
    # moe --torch-threads 1 vs 2, by hand) Bevy and prefetch were faster on both cores, the disk no less busy
    torch_threads: int | None = None
    context_length: int | None = None  # cap on prompt + answer; None = the model's, at most DEFAULT_CONTEXT
    # "native": 16-bit weights multiply in their own dtype (f32 accumulation); "f32": widened to
    # f32 as they are read, exact against transformers in f32; "auto" (unless KV is f32, exact
    # mode, then f32): native where this CPU's torch has a 16-bit kernel (AVX512-BF16, AMX),
    # widened where it has not (AVX2): engine/runtime/stored.py
    compute: str = "auto"

    def native_rows_for(self, weight_dtype: torch.dtype) -> int:
        """Up to how many rows matmuls run native (see `compute`) for weights of this dtype."""
        if self.compute not in COMPUTES:
            raise EngineError(f"compute must be one of {', '.join(COMPUTES)}, not {self.compute!r}")
        if self.compute == "auto":
            return 0 if self.kv_precision == "f32" else native_rows(weight_dtype)
        return ALL_ROWS if self.compute == "native" else 0

    @classmethod
    def from_options(cls, options: Any) -> "MoEConfig":
        """EngineOptions -> MoEConfig: cache_budget_bytes, plus any field in options.extra."""
        known = {f.name for f in fields(cls)}
        extra = dict(getattr(options, "extra", None) or {})
        bad = sorted(set(extra) - known)
        if bad:
            raise EngineError(f"unknown moe engine setting(s): {', '.join(bad)}; known: {', '.join(sorted(known))}")
        if getattr(options, "cache_budget_bytes", None) is not None:
            extra.setdefault("cache_budget_bytes", options.cache_budget_bytes)
        return cls(**extra)


COMPUTES = ("auto", "native", "f32")


def compute_name(weight_dtype: str, rows: int) -> str:
    """How the matmuls run, as `memory["compute"]` and `bench moe` say it: "bf16" (the weights'
    dtype), "f32" (widened), or "bf16 up to N rows, else f32" for a row limit."""
    if not rows:
        return "f32"
    return weight_dtype if rows == ALL_ROWS else f"{weight_dtype} up to {rows} rows, else f32"


class _NoStream:
    """Generation wants a ModelStream; the scheduler feeds logits instead."""

    past = 0

    def close(self) -> None:
        pass


class MoEEngine(InboxEngine):
    def __init__(self, store_dir: Path, model_id: str, config: MoEConfig = MoEConfig(),
                 progress: Progress | None = None,
                 logits_hook: Callable[[str, np.ndarray], None] | None = None) -> None:
        super().__init__()
        if config.scheduler not in SCHEDULERS + ABLATIONS:
            raise EngineError(f"unknown scheduler {config.scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
        if config.max_concurrent < 1:
            raise EngineError("max_concurrent must be at least 1")
        from transformers import AutoTokenizer

        report = progress or (lambda _m, _f: None)
        self.model_id = model_id
        self.config = config
        self.logits_hook = logits_hook  # tests: sees every logits vector handed to sampling
        # torch's thread count is the process's: taken while the engine runs, given back on close
        self._threads_before = torch.get_num_threads()
        self.torch_threads = config.torch_threads or os.cpu_count() or 1
        torch.set_num_threads(self.torch_threads)
        if config.kv_precision not in KV_DTYPES:
            raise EngineError(f"kv_precision must be one of {', '.join(KV_DTYPES)}, not {config.kv_precision!r}")
        self.store = ExpertStore(store_dir, StoreConfig(direct=config.direct_io, verify=config.verify))
        try:
            self.context_length = engine_context(store_dir, config.context_length)
            report("loading the resident weights", 0.3)
            native = config.native_rows_for(STORAGE_DTYPES.get(self.store.index.dtype, torch.float32))
            self.model = MoEModel(store_dir, self.store.index, kv_slots=config.max_concurrent,
                                  kv_capacity=self.context_length, kv_dtype=KV_DTYPES[config.kv_precision],
                                  native_rows=native)
            if self.store.index.dtype != "f32":
                # compiled (or loaded from numba's cache) before memory_room(): what the
                # compiler takes is then not counted as room for experts
                report("preparing the matmul kernel", 0.5)
                widen_kernel.warm()
            budget = config.cache_budget_bytes
            if config.scheduler == "resident":  # the upper bound: every expert in RAM
                budget = self.store.index.total_expert_bytes
            try:
                m, ix = self.model, self.store.index
                working = working_bytes(m.hidden, m.heads, int(m.config.vocab_size), ix.top_k, ix.intermediate,
                                        config.prefill_chunk, self.context_length, config.max_concurrent)
                budget = plan_budget(ix, budget, memory_room(), m.kv.nbytes, working)
                self.cache = ExpertCache(self.store.index, budget)
            except BudgetError as e:
                raise EngineError(str(e)) from None
            self.memory = {"resident_bytes": self.model.resident_bytes(), "kv_reserve_bytes": self.model.kv.nbytes,
                           "cache_budget_bytes": budget, "working_bytes": working, "kv_precision": config.kv_precision,
                           "weights": self.store.index.dtype,
                           "compute": compute_name(self.store.index.dtype, native)}
            if config.scheduler == "resident":
                report("loading every expert", 0.6)
                self.cache.preload(self.store, self.store.keys)
                self.store.bytes_read = self.store.reads = 0  # statistics count serving only
            self.tokenizer = AutoTokenizer.from_pretrained(store_dir)
        except BaseException:
            self.store.close()
            torch.set_num_threads(self._threads_before)
            raise
        self.eos_ids = eos_token_ids(Path(store_dir), self.tokenizer)
        self.fetcher = Fetcher(self.store, self.cache, config.fetch_threads)
        self.scheduler = make_scheduler(config.scheduler, self.model, self.cache, self.fetcher)
        self._gens: dict[str, Generation] = {}
        self._start_scheduler(f"flotilla-moe-{model_id}")
        report("moe engine ready", 1.0)

    @classmethod
    def from_spec(cls, spec: str, config: MoEConfig = MoEConfig(), progress: Progress | None = None,
                  **kw: Any) -> "MoEEngine":
        """Resolve a model spec (demo id, HF folder, hub id), convert it to an
        expert store once, and open it."""
        from engine.models import resolve_model

        resolved = resolve_model(spec, progress)
        if resolved.weights_format != "safetensors":
            raise EngineError(f"{resolved.model_id}: the moe engine needs a safetensors checkpoint")
        try:
            store_dir = ensure_store(resolved.path, resolved.fingerprint, progress, weights=config.weights)
        except StoreError as e:
            raise EngineError(str(e)) from None
        return cls(store_dir, resolved.model_id, config, progress, **kw)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.model_id, "moe", "CPU", self.context_length,
                          tool_format.of(self.tokenizer).name)

    def set_prompt_cache(self, streams: int) -> None:
        """Prompt caching on (streams > 0) or off. The kept KV lives in the KV slots no request
        runs in (model.KVPool), so its size is bounded by the reserve, not a count."""
        self.model.kv.set_keep(streams > 0)

    def stats(self) -> dict[str, Any]:
        """Counters for benchmarks (read while idle for consistent figures)."""
        c, f, s = self.cache.stats, self.fetcher.stats, self.scheduler.stats
        return {**self.memory, "scheduler": self.config.scheduler, "cache_slots": self.cache.capacity,
                "direct_io": self.store.direct, "demands": c.demands, "hits": c.hits,
                "hit_rate": c.hit_rate, "bytes_read": self.store.bytes_read, "blobs_read": self.store.reads,
                "speculative_reads": f.speculative, "guess_reads": f.fills,
                "unused_bytes": self.cache.guessed_unused() * self.cache.index.blob_bytes,
                "io_busy_s": self.fetcher.busy_time(), "compute_s": s.compute_s,
                # wall time the disk had nothing to read, by what the scheduler was doing then
                "disk_idle_s": self.fetcher.idle_by_phase(),
                "wait_s": s.wait_s, "passes": s.passes, "groups": s.groups,
                # the scheduler thread's seconds in each step (PHASES; "scheduling" holds the others)
                "phase_s": dict(s.phase_s),
                "two_wave_passes": s.two_wave_passes, "kv_kept_tokens": self.model.kv.kept_tokens,
                "mean_batch": s.batch_rows / s.batches if s.batches else 0.0,
                "mean_group": float(np.mean(s.group_sizes)) if s.group_sizes else 0.0}

    # -- Engine hooks ----------------------------------------------------------------------
    def _shutdown(self) -> None:
        self._stop_scheduler()
        self.fetcher.close()
        self.cache.close()
        self.store.close()
        torch.set_num_threads(self._threads_before)

    # -- the scheduler thread ------------------------------------------------------------------
    def _run(self) -> None:
        waiting: collections.deque[tuple[GenerateRequest, float]] = collections.deque()
        while not self._stop.is_set():
            try:
                self._take_inbox(waiting, block=not self._gens and not waiting)
                self._drop_cancelled(waiting)
                while waiting and len(self._gens) < self.config.max_concurrent:
                    self._admit(*waiting.popleft())
                if self._gens:
                    self.scheduler.tick()
            except Exception as e:  # a bug in a step: its requests end with an error, new ones are served
                log.exception("moe engine scheduler error")
                self._fail_running(e)
        self._take_inbox(waiting, block=False)
        for gen in list(self._gens.values()):
            self._end(gen, finished(gen, "error", error="the engine was closed", error_code="closed"))
        refuse_waiting(self._emit, waiting)

    def _fail_running(self, err: Exception) -> None:
        """A step raised. Its requests may be half-way through a layer: every running one ends
        (step_failed), and the next ones run on a fresh scheduler over an unpinned cache."""
        for sid, gen in list(self._gens.items()):
            try:
                self.scheduler.remove(sid)  # frees its KV slot
            except Exception:  # its state was half-made: the answer still ends, below
                log.exception("freeing %s after a scheduler error", sid)
            self._end(gen, step_failed(gen, err))
        self.scheduler = make_scheduler(self.config.scheduler, self.model, self.cache, self.fetcher)
        self.cache.unpin_all()

    def _drop_cancelled(self, waiting: collections.deque) -> None:
        for sid in self._take_cancelled(waiting, self._gens):
            self.scheduler.remove(sid)
            self._end(self._gens[sid], finished(self._gens[sid], "cancelled"))

    def _admit(self, request: GenerateRequest, t_submit: float) -> None:
        try:
            ids = request_ids(self.tokenizer, request)
            gen = Generation.create(request, ids, _NoStream(), self.tokenizer, self.eos_ids,
                                    self.context_length, self.config.prefill_chunk, t_submit)
        except Exception as e:
            self._emit(TokenEvent(request.request_id, finish_reason="error", error=one_line(e),
                                  error_code=error_code_of(e), usage=Usage(0, 0)))
            return
        gen.t_start = time.perf_counter()
        try:  # a KV slot per request: admission never exceeds them, so this failing is a bug, reported
            seq = Seq(gen.request_id, self._on_logits, self._on_error, list(ids), chunk=self.config.prefill_chunk)
            self.scheduler.add(seq)
        except RuntimeError as e:
            self._emit(TokenEvent(request.request_id, finish_reason="error", error=one_line(e),
                                  error_code=error_code_of(e), usage=Usage(0, 0)))
            return
        gen.cached = gen.prefilled = seq.state.past  # its KV slot held them from an earlier answer
        self._gens[gen.request_id] = gen

    def _on_logits(self, seq: Seq, logits: torch.Tensor) -> list[int] | None:
        gen = self._gens[seq.sid]
        gen.prefilled = len(gen.prompt_ids)
        gen.logits = logits.numpy().astype(np.float32, copy=True)  # [vocab]
        if self.logits_hook is not None:
            self.logits_hook(seq.sid, gen.logits)
        event = decode_one(gen)
        if event.final:
            self._end(gen, event)
            return None
        self._emit(event)
        token, gen.pending = gen.pending, None  # fed by the scheduler, not a ModelStream
        return [token]

    def _on_error(self, seq: Seq, err: BaseException) -> None:
        gen = self._gens.get(seq.sid)
        if gen is not None:
            self._end(gen, finished(gen, "error", error=one_line(err)))

    def _end(self, gen: Generation, event: TokenEvent) -> None:
        self._gens.pop(gen.request_id, None)
        self._emit(event)


def open_moe_engine(spec: str, options: Any, progress: Progress | None = None) -> MoEEngine:
    """The factory's opener for `--engine moe` (EngineOptions -> MoEConfig)."""
    if str(getattr(options, "device", "CPU")).upper() != "CPU":
        raise EngineError(f"the moe engine runs on the CPU only, not {options.device!r}")
    config = dataclasses.replace(MoEConfig.from_options(options), **asked_kv_precision(options))
    return MoEEngine.from_spec(spec, config, progress)
