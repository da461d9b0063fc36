"""SparseEngine: the Engine interface over the sparse model.

The scheduler, chat templating, sampling, detokenizing and stop strings are
the round-robin loop's (BackendLoop, engine/scheduler/loop.py); only the backend differs: a
SparseBackend whose streams run transformers' decoder with SparseMLPs (the
torch backend's stream class, reused). Requests run one at a time by
default: the neuron cache and the previous-token sets are shared, and
interleaving requests would destroy the temporal locality the cache lives on.
An ended answer's KV is kept for a follow-up prompt that starts the same way
(prompt caching, torch_backend.KeptCaches), within the KV reserve of
max_concurrent contexts.

    engine = SparseEngine.from_spec("demo", SparseConfig(cache_budget_bytes=...))
    engine.set_cache_budget(bytes)   # any thread, while generating; applied between layers
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from engine.runtime.backend import Progress
from engine.runtime.torch_backend import KeptCaches, TorchStream
from engine.runtime.torch_kv import KV_DTYPES, asked_kv_precision
from engine.core.interface import Engine, EngineError
from engine.scheduler.loop import BackendLoop

from engine.models.profile import DEFAULT_CONTEXT, engine_context  # KV bounded per request: one default
from engine.sparse.cache import BudgetError
from engine.sparse.calibrate import CalibConfig, ensure_calibration, work_dir
from engine.platform.memory import memory_room, release_free_heap
from engine.runtime.budget import fit_budget
from engine.sparse.memory import MemoryPolicy
from engine.sparse.model import SLICE_BYTES, SparseMLP, SparseRuntime, SparseRuntimeConfig
from engine.sparse.predictor import PredictorConfig
from engine.sparse.store import BundleStore, StoreConfig, build_store
from engine.sparse.weights import MappedWeights, build_skeleton, ffn_layout, put_weights


@dataclass
class SparseConfig:
    mode: str = "predicted"  # "predicted" (stream gate+up+down, predictor picks) or "exact" (gate resident)
    sparsity: float = 0.8  # SwiGLU target share of zeroed neurons (ReLU models use natural zeros); 0 = dense
    prefetch: str = "lowrank"  # lowrank | temporal | both | none (none = on-demand baseline)
    cache_budget_bytes: int | None = None  # neuron cache RAM (None: what is left once weights and KV are in)
    context_length: int | None = None  # prompt + answer per request (None: the model's, at most DEFAULT_CONTEXT)
    rank: int = 64  # low-rank predictor width
    text: Path | None = None  # calibration text (None = assets/demo/corpus.txt)
    store: StoreConfig = field(default_factory=StoreConfig)  # I/O settings
    memory: MemoryPolicy = field(default_factory=MemoryPolicy)  # free-RAM adaptation
    warm: bool = False  # fill the cache with every neuron it can hold at start (all-resident runs)
    prefetch_top: float = 0.25  # read ahead only the most confident guesses (share of the mean active count)
    kv_precision: str = "f16"  # keys and values kept at "f16" (16-bit, as the MoE engine) or "f32" (exact)

    @classmethod
    def from_options(cls, budget: int | None, extra: dict[str, Any]) -> "SparseConfig":
        known = {k: v for k, v in extra.items() if k in ("mode", "sparsity", "prefetch", "rank", "text", "warm",
                                                             "prefetch_top", "context_length", "kv_precision")}
        unknown = set(extra) - set(known)
        if unknown:
            raise EngineError(f"unknown sparse engine option(s): {', '.join(sorted(unknown))}")
        return cls(cache_budget_bytes=budget, **known)


class SparseBackend:
    """ModelBackend: the skeleton with resident attention/embeddings and SparseMLPs."""

    def __init__(self, model_dir: Path, cfg: SparseConfig, progress: Progress | None = None,
                 context_length: int = DEFAULT_CONTEXT, max_concurrent: int = 1) -> None:
        report = progress or (lambda _m, _f: None)
        if cfg.kv_precision not in KV_DTYPES:
            raise EngineError(f"kv_precision must be one of {', '.join(KV_DTYPES)}, not {cfg.kv_precision!r}")
        self.model_dir, self.device, self.cfg = Path(model_dir), "CPU", cfg
        self.layout = layout = ffn_layout(model_dir)
        store_kind = "exact" if cfg.mode == "exact" else "full"
        from engine.sparse.store import STORE_VERSION

        store_dir = work_dir(model_dir) / f"store-{store_kind}-v{STORE_VERSION}"
        weights = MappedWeights(model_dir)
        if not (store_dir / "meta.json").exists():
            build_store(weights, layout, store_dir, store_kind, report)
        self.calib = ensure_calibration(model_dir, calib_config(cfg), report)
        store = BundleStore(store_dir, cfg.store)
        report("loading attention and embeddings", 0.9)
        self.model = build_skeleton(model_dir)
        self.resident_bytes = put_weights(self.model, weights, layout, resident=True, with_ffn=False)
        gates = None
        if cfg.mode == "exact":  # resident in the checkpoint's dtype; the own predictors are not used
            gates = [weights.torch(layout.key(l, "gate")).clone() for l in range(layout.num_layers)]
            self.calib.own = [None] * layout.num_layers
        del weights  # the mmap of the checkpoint is not needed any more
        # Calibration's mmap-backed model holds reference cycles (bound forwards): collect it now,
        # so its mapped pages are gone before the budget looks at what this process may still take;
        # then hand the heap that store building and calibration freed back to the OS.
        gc.collect()
        release_free_heap()
        row_bytes = store.cache_slot_bytes
        self.min_budget = min_cache_bytes(self.calib, cfg.mode, row_bytes)
        all_rows = layout.num_layers * layout.neurons * row_bytes
        budget = cfg.cache_budget_bytes
        if budget is not None and budget < self.min_budget:
            store.close()
            raise BudgetError(f"a neuron cache budget of {budget / 2**20:.1f} MiB cannot hold one layer's active "
                              f"set; the minimum for this model and mode is {self.min_budget / 2**20:.1f} MiB "
                              f"({self.min_budget} bytes)")
        kv_dtype = KV_DTYPES[cfg.kv_precision]
        self.kv_reserve_bytes = kv_reserve_bytes(self.model.config, context_length, max_concurrent,
                                                 kv_dtype.itemsize)
        self.kept = KeptCaches(self.model, max_concurrent, kv_dtype)  # prompt caching, within the KV reserve
        self.working_bytes = working_bytes(self.model.config, context_length,
                                           layer_rows_bytes=layout.neurons * row_bytes)
        try:  # the same rule as the MoE engine: decided now that the resident weights are in
            budget = fit_budget(budget, self.min_budget, all_rows, memory_room(), self.kv_reserve_bytes,
                                self.working_bytes, what="neuron cache")
        except BudgetError:
            store.close()
            raise
        self.rt = SparseRuntime(layout, store, self.calib, budget, self.min_budget,
                                SparseRuntimeConfig(cfg.mode, cfg.prefetch, cfg.prefetch_top, cfg.memory), gates)
        self.gates_bytes = sum(g.numel() * g.element_size() for g in gates) if gates else 0
        for l in range(layout.num_layers):
            self.model.get_submodule(f"{layout.prefix}.{l}").mlp = SparseMLP(self.rt, l)
        if cfg.warm:
            self.warm()
        report("sparse model ready", 1.0)

    def warm(self) -> None:
        """Read as many neurons as fit, spread evenly over layers (all-resident runs)."""
        import numpy as np

        per = min(self.layout.neurons, self.rt.cache.capacity // self.layout.num_layers)
        for l in range(self.layout.num_layers):
            ids = np.arange(per)
            self.rt.cache.tick += 1
            self.rt.cache.insert(l, ids, self.rt.store.read(l, ids))

    def new_stream(self, prompt_ids: Sequence[int] = ()) -> TorchStream:
        """A stream for a prompt: on the kept KV of an earlier answer sharing its start, if any."""
        self.rt.forget_sequence()
        return self.kept.open(prompt_ids)

    def set_prompt_cache(self, streams: int) -> None:
        """Prompt caching on (streams > 0) or off. Kept KV counts as one of the max_concurrent
        contexts of the KV reserve, so its size is bounded by the reserve, not by `streams`."""
        self.kept.set_keep(streams > 0)

    def fixed_bytes(self) -> int:
        """FFN-side RAM besides the cache: predictors, and the gates in exact mode."""
        return self.calib.predictor_bytes() + self.gates_bytes

    def close(self) -> None:
        if self.rt is not None:
            self.rt.close()
        self.rt = None
        self.kept.set_keep(False)
        self.model = None


def calib_config(cfg: SparseConfig) -> CalibConfig:
    """The calibration a SparseConfig runs on (its threshold, text and predictor width)."""
    return CalibConfig(sparsity=cfg.sparsity, text=cfg.text, predictor=PredictorConfig(rank=cfg.rank))


def min_cache_bytes(calib, mode: str, row_bytes: int) -> int:
    """The smallest neuron cache: one layer's largest active set (predicted mode: or the
    predictor's largest set, whichever is bigger), in cache slots of row_bytes."""
    per_layer = calib.max_active if mode == "exact" else [
        max(a, p) for a, p in zip(calib.max_active, calib.max_predicted)]
    return max(per_layer) * row_bytes


def _kv_row(config) -> tuple[int, int]:
    """(layers, key + value elements one position takes in one layer)."""
    c = getattr(config, "text_config", config)
    heads = int(c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    return int(c.num_hidden_layers), 2 * kv_heads * head_dim


def kv_reserve_bytes(config, context: int, requests: int, element: int = 4) -> int:
    """KV of `requests` full contexts in the torch stream's cache, `element` bytes a key or value
    (2 at the default kv_precision f16, 4 at f32)."""
    layers, row = _kv_row(config)
    return layers * row * element * int(context) * int(requests)


def working_bytes(config, context: int, chunk: int = 512, layer_rows_bytes: int = 0) -> int:
    """RAM one prefill chunk needs beyond weights, KV and cache (a generous estimate): its rows
    through attention and the FFN, its attention scores, the logits of its last position (the
    torch stream keeps only those), the FFN rows one step gathers out of the cache and the
    misses staged on their way from the store: a chunk of many tokens needs nearly every neuron
    of a layer, but they go through a slice at a time (model.SLICE_BYTES, at most
    layer_rows_bytes), one slice gathered and two staged, and slack."""
    c = getattr(config, "text_config", config)
    rows = chunk * (16 * int(c.hidden_size) + 3 * int(c.intermediate_size)) * 4
    scores = int(c.num_attention_heads) * chunk * int(context) * 4
    logits = int(c.vocab_size) * 4
    slices = 3 * min(SLICE_BYTES, int(layer_rows_bytes))
    widened = _kv_row(config)[1] * int(context) * 4 * 2  # one layer's keys and values widened to f32 for
    #                                                      attention (torch_kv), and the cat that grows them
    return rows + scores + logits + slices + widened + (32 << 20)


class _NoSpeculation:
    """BackendLoop's speculation hooks, all off (a request always takes the plain step)."""

    def new_stream(self, request):
        return None

    def open(self, request, gen):
        return None

    def session(self, gen):
        return None

    def end(self, gen) -> None:
        pass

    def close(self) -> None:
        pass


class SparseEngine(BackendLoop):
    """The round-robin loop (engine/scheduler/loop.py) over a SparseBackend; no speculation."""

    KIND = "sparse"

    def __init__(self, model_path: Path, model_id: str, cfg: SparseConfig = SparseConfig(),
                 max_concurrent: int = 1, progress: Progress | None = None, prefill_chunk: int = 512) -> None:
        torch.set_grad_enabled(False)
        context_length = engine_context(model_path, cfg.context_length)
        backend = SparseBackend(Path(model_path), cfg, progress, context_length, max_concurrent)
        super().__init__(backend, model_id, context_length, max_concurrent, prefill_chunk,
                         lambda _tokenizer: _NoSpeculation())

    @classmethod
    def from_spec(cls, spec: str, cfg: SparseConfig = SparseConfig(), progress: Progress | None = None,
                  **kw: Any) -> "SparseEngine":
        from engine.models import resolve_model

        resolved = resolve_model(spec, progress)
        return cls(Path(resolved.path), resolved.model_id, cfg, progress=progress, **kw)

    # -- sparse-only API ----------------------------------------------------------------
    def set_cache_budget(self, nbytes: int) -> None:
        """Move the neuron cache budget while running (raises EngineError below the minimum)."""
        try:
            self.backend.rt.set_budget(int(nbytes))
        except BudgetError as e:
            raise EngineError(str(e)) from None

    @property
    def runtime(self) -> SparseRuntime:
        return self.backend.rt

    def stats(self) -> dict:
        rt = self.backend.rt
        c = rt.cache
        return {"cache_budget_bytes": c.budget_bytes, "cache_used_bytes": c.used_rows * c.row_bytes,
                "resident_bytes": self.backend.resident_bytes, "kv_reserve_bytes": self.backend.kv_reserve_bytes,
                "kv_precision": self.backend.cfg.kv_precision, "working_bytes": self.backend.working_bytes,
                "min_budget_bytes": self.backend.min_budget, "hits": c.hits, "misses": c.misses,
                "io": rt.store.stats.snapshot(), "prefetch": rt.prefetcher.stats.snapshot()}


def open_sparse(spec: str, options, progress: Progress | None = None) -> Engine:
    """Factory opener: `--engine sparse` (EngineOptions.cache_budget_bytes, extra = SparseConfig fields)."""
    cfg = SparseConfig.from_options(options.cache_budget_bytes, dict(options.extra or {}))
    cfg = replace(cfg, **asked_kv_precision(options))
    try:
        return SparseEngine.from_spec(spec, cfg, progress=progress)
    except BudgetError as e:
        raise EngineError(str(e)) from None


__all__ = ["SparseBackend", "SparseConfig", "SparseEngine", "open_sparse"]
