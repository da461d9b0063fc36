"""Engines as the app opens them: the kinds it offers, speculation choices, open_engine, the API server."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.client._common import Progress, one_line
from engine.core.interface import Engine

if TYPE_CHECKING:
    from engine.serve.api import ApiServer
    from engine.speculative.config import SpecConfig


@dataclass(frozen=True)
class EngineKind:
    name: str  # the factory key: "local", "pipeline", "moe", "sparse"
    label: str  # what the UI shows
    description: str  # one line from the factory
    available: bool  # its module imports
    reason: str = ""  # why not, when unavailable


# kind -> (module that must import, UI label). Kinds the factory does not know
# yet are still listed, disabled, so the user sees what is coming.
_KIND_MODULES = {
    "pipeline": ("engine.pipeline.runner", "Distributed pipeline"),
    "local": ("engine.local.paged", "Local dense"),
    "moe": ("engine.moe.engine", "Local MoE offload"),
    "sparse": ("engine.sparse.engine", "Local sparse"),
}


def engine_kinds() -> list[EngineKind]:
    """Every engine kind the UI offers, with whether it can open now. Blocking
    (imports each engine's module, which may pull in torch)."""
    from engine.local.factory import ENGINE_KINDS

    out = []
    for name, (module, label) in _KIND_MODULES.items():
        desc = ENGINE_KINDS[name][1] if name in ENGINE_KINDS else ""
        if name not in ENGINE_KINDS:
            out.append(EngineKind(name, label, desc, False, "not built yet (engine.local.factory "
                                                            f"has no {name!r} engine)"))
            continue
        try:
            importlib.import_module(module)
        except Exception as e:  # a half-built engine must not take the app down
            out.append(EngineKind(name, label, desc, False,
                                  f"{module} does not import: {one_line(e)}"))
            continue
        out.append(EngineKind(name, label, desc, True))
    for name, (_opener, desc) in ENGINE_KINDS.items():  # kinds added later by others
        if name not in _KIND_MODULES:
            out.append(EngineKind(name, name.capitalize(), desc, True))
    return out


@dataclass(frozen=True)
class SpecChoice:
    """Speculative decoding as the app offers it (engine/speculative): the
    engine's default for every request; a request can still say otherwise."""

    mode: str = "off"  # "off" | "draft" (a small draft model) | "lookup" (prompt n-grams, no model)
    k: int = 4  # drafted tokens per step (the start value when adaptive)
    adaptive: bool = True  # adapt K to the running acceptance rate
    draft_model: str | None = None  # draft model spec (demo-draft for demo); None = the target's known draft


SPEC_MODES = ("off", "draft", "lookup")
SPEC_MAX_K = 16


def speculative_available() -> tuple[bool, str]:
    """Speculative decoding (engine/speculative, mask-based rollback): can it be switched on?"""
    try:
        importlib.import_module("engine.speculative.config")
    except Exception as e:
        return False, f"speculative decoding does not import: {one_line(e)}"
    return True, ""


def draft_models(spec: str) -> list[str]:
    """Draft model choices for a target, the known draft first (demo -> demo-draft)."""
    from engine.models.demo import demo_ids
    from engine.speculative.config import known_draft

    first = known_draft(spec)
    rest = [d for d in demo_ids() if d.endswith("draft") and d != first]
    return ([first] if first else []) + rest


def spec_config(choice: SpecChoice | None) -> SpecConfig | None:
    if choice is None or choice.mode == "off":
        return None
    from engine.speculative.config import SpecConfig

    return SpecConfig(mode=choice.mode, k=choice.k, k_max=max(choice.k, 8), adaptive=choice.adaptive,
                      draft_model=choice.draft_model if choice.mode == "draft" else None)


def engine_load(engine: Engine | None) -> tuple[int, int] | None:
    """(running, queued) requests of an engine now, when it can say (engine.load());
    None otherwise. Cheap (a counter under a lock), but call it off the GUI thread."""
    load = getattr(engine, "load", None)
    if load is None:
        return None
    try:
        now = load()
        return int(now.running), int(now.queued)
    except Exception:
        return None


def open_engine(spec: str = "demo", device: str = "CPU", progress: Progress | None = None,
                kind: str = "local", cache_budget_bytes: int | None = None,
                context_length: int | None = None, streams: int | None = None,
                speculative: SpecChoice | None = None) -> Engine:
    """Open an engine of `kind` for `spec` (a demo id, a model folder or a hub id).

    Blocking and slow (it may build a demo model and compile it): call it off
    the GUI thread. `progress` is called from that same thread. `speculative`
    (local engine): the default speculation of its requests.
    """
    if kind == "local":
        from engine.models import resolve_model
        from engine.local.factory import open_whole_model  # lazy: pulls in torch/OpenVINO

        kw: dict[str, Any] = {}
        if context_length:
            kw["context_length"] = context_length
        if streams:
            kw["max_concurrent"] = streams
        spec_cfg = spec_config(speculative)
        if spec_cfg is not None:
            kw["speculative"] = spec_cfg
        resolved = resolve_model(spec, progress)
        return open_whole_model(Path(resolved.path), resolved.model_id, progress, device=device, **kw)
    from engine.local.factory import EngineOptions, open_engine as factory_open

    return factory_open(spec, kind, EngineOptions(device=device, cache_budget_bytes=cache_budget_bytes),
                        progress)


def start_api_server(engine: Engine, port: int = 8000, host: str = "127.0.0.1", api_key: str | None = None,
                     no_auth: bool = False) -> ApiServer:
    """Serve `engine` on an OpenAI-compatible API; returns the started server
    (.url, .port, .stop(), .access: the key it requires and the notice to show).
    Beyond loopback a key is required (engine.serve.auth). Blocking until it
    listens; OSError if the port is taken."""
    from engine.serve.api import ApiServer, create_app
    from engine.serve.auth import decide

    access = decide(host, port, api_key, no_auth)
    server = ApiServer(create_app(engine, api_key=access.api_key), host, port)
    server.access = access
    return server.start()


def settle_heap() -> None:
    """Once an engine is ready: collect, then freeze the heap, so that no full collection
    walks what torch & co. hold while it answers (engine.platform.memory.settle_heap)."""
    from engine.platform.memory import settle_heap as settle

    settle()
