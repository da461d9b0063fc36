"""Open any engine by kind: what `--engine` in the CLI and the API selects.

Each kind maps to a function (spec, options) -> Engine, imported lazily so that
`flotilla --help` stays fast and a missing optional part only fails when used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from engine.serve.interface import Engine, EngineError

Progress = Callable[[str, float], None]


@dataclass(frozen=True)
class EngineOptions:
    """Settings shared by the engine kinds; each kind reads what applies to it."""

    device: str = "CPU"  # OpenVINO device: CPU, GPU, NPU, AUTO
    precision: str = "default"  # "f32" = exact f32 math + f32 KV; "default" = device's choice
    backend: str = "openvino"  # local engine only: "openvino" or "torch" (reference)
    cache_budget_bytes: int | None = None  # moe/sparse: RAM for experts/neurons (None = derive from free RAM)
    extra: dict[str, Any] = field(default_factory=dict)  # kind-specific settings


def _open_local(spec: str, options: EngineOptions, progress: Progress | None) -> Engine:
    from engine.serve.local import LocalEngine

    return LocalEngine.from_spec(spec, device=options.device, precision=options.precision,
                                 backend=options.backend, progress=progress)


# kind -> (opener, one-line description for --help)
ENGINE_KINDS: dict[str, tuple[Callable[[str, EngineOptions, Progress | None], Engine], str]] = {
    "local": (_open_local, "the whole model on this PC (OpenVINO)"),
    "moe": (lambda spec, options, progress: __import__("engine.moe.engine", fromlist=["x"]).open_moe_engine(spec, options, progress), "MoE model, experts on disk (Bevy scheduler)"),  # noqa: E501
    "sparse": (lambda spec, options, progress: __import__("engine.sparse.engine", fromlist=["x"]).open_sparse(spec, options, progress), "sparse FFN: neurons streamed from storage into a RAM cache (NeuroPrefetcher)"),  # noqa: E501
    "pipeline": (lambda spec, options, progress: _open_pipeline(spec, options, progress), "layers split over local stage processes (pipeline shards; extra: stages, split, threads)"),  # noqa: E501
}


def _open_pipeline(spec: str, options: EngineOptions, progress: Progress | None) -> Engine:
    from engine.pipeline.runner import open_pipeline_engine

    return open_pipeline_engine(spec, options, progress)


def open_engine(spec: str, kind: str = "local", options: EngineOptions | None = None,
                progress: Progress | None = None) -> Engine:
    try:
        opener, _ = ENGINE_KINDS[kind]
    except KeyError:
        raise EngineError(f"unknown engine {kind!r}; choose one of: {', '.join(ENGINE_KINDS)}") from None
    return opener(spec, options or EngineOptions(), progress)
