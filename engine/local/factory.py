"""Open any engine by kind: what `--engine` in the CLI and the API selects.

Each kind maps to a function (spec, options) -> Engine, imported lazily so that
`flotilla --help` stays fast and a missing optional part only fails when used.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.core.interface import Engine, EngineError

Progress = Callable[[str, float], None]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    """Settings shared by the engine kinds; each kind reads what applies to it."""

    device: str = "CPU"  # OpenVINO device: CPU, GPU, NPU, AUTO
    precision: str = "default"  # "f32" = exact f32 math + f32 KV; "default" = device's choice
    backend: str = "openvino"  # local engine only: "openvino" or "torch" (reference)
    cache_budget_bytes: int | None = None  # moe/sparse: RAM for experts/neurons (None = derive from free RAM)
    extra: dict[str, Any] = field(default_factory=dict)  # kind-specific settings


def _lazy(target: str) -> Callable[[str, EngineOptions, Progress | None], Engine]:
    """An opener that imports "package.module:function" only when called, so
    `flotilla --help` stays fast and a broken optional engine fails only when used."""

    def opener(spec: str, options: EngineOptions, progress: Progress | None) -> Engine:
        module_name, func_name = target.split(":")
        module = importlib.import_module(module_name)
        return getattr(module, func_name)(spec, options, progress)

    opener.__qualname__ = f"open[{target}]"
    return opener


def open_whole_model(path: Any, model_id: str, progress: Progress | None = None, backend: str = "openvino",
                     **kw: Any) -> Engine:
    """The local engine on a resolved model folder: the paged engine (every request in one
    forward pass) on OpenVINO; the one-request-per-turn loop on the torch reference backend,
    or where the model's attention has no paged form (said in the log)."""
    from engine.scheduler.loop import LocalEngine

    if backend == "openvino":
        from engine.runtime.ov_paged import PagedUnsupported
        from engine.local.paged import PagedEngine

        try:
            return PagedEngine(path, model_id, progress=progress, **kw)
        except PagedUnsupported as e:
            log.warning("%s; serving one request per turn instead", e)
    return LocalEngine(path, model_id, backend=backend, progress=progress, **kw)


def _open_local(spec: str, options: EngineOptions, progress: Progress | None) -> Engine:
    from pathlib import Path

    from engine.models import resolve_model

    resolved = resolve_model(spec, progress)
    kw = {k: options.extra[k] for k in ("context_length", "speculative", "max_concurrent") if k in options.extra}
    return open_whole_model(Path(resolved.path), resolved.model_id, progress, options.backend,
                            device=options.device, precision=options.precision, **kw)


def _open_loop(spec: str, options: EngineOptions, progress: Progress | None) -> Engine:
    from engine.scheduler.loop import LocalEngine

    return LocalEngine.from_spec(spec, device=options.device, precision=options.precision,
                                 backend=options.backend, progress=progress,
                                 context_length=options.extra.get("context_length"),  # None: the one default
                                 speculative=options.extra.get("speculative"))  # a SpecConfig or None


# kind -> (opener, one-line description for --help)
ENGINE_KINDS: dict[str, tuple[Callable[[str, EngineOptions, Progress | None], Engine], str]] = {
    "local": (_open_local, "the whole model on this PC, every request in one forward pass (OpenVINO, paged KV "
                           "cache)"),
    "loop": (_open_loop, "the whole model on this PC, one token of each request per turn (a KV state per request)"),
    "batched": (_lazy("engine.local.batched:open_batched"),
                "the whole model on this PC, concurrent requests batched (openvino_genai continuous batching)"),
    "pipeline": (_lazy("engine.pipeline.runner:open_pipeline_engine"),
                 "layers split over local stage processes (pipeline shards; extra: stages, split, threads)"),
    "moe": (_lazy("engine.moe.engine:open_moe_engine"), "MoE model, experts on disk (Bevy scheduler)"),
    "sparse": (_lazy("engine.sparse.engine:open_sparse"),
               "sparse FFN: neurons streamed from storage into a RAM cache (NeuroPrefetcher)"),
}


def open_engine(spec: str, kind: str = "local", options: EngineOptions | None = None,
                progress: Progress | None = None) -> Engine:
    try:
        opener, _ = ENGINE_KINDS[kind]
    except KeyError:
        raise EngineError(f"unknown engine {kind!r}; choose one of: {', '.join(ENGINE_KINDS)}") from None
    return opener(spec, options or EngineOptions(), progress)
