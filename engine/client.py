"""The engine facade for the desktop app.

This is the only engine module, besides engine.protocol, that app/ may import
(import-linter enforces it). It keeps the app's view of the engines to three
names: open an engine, list the demo models, and the types for annotations.

Heavy imports (torch, OpenVINO, transformers) happen lazily inside the
functions, so importing this module is cheap and the app can show its window
before any engine code is loaded. No Qt here: the app calls these functions
from its background runner, never on the GUI thread.
"""

from __future__ import annotations

from typing import Callable

# Light modules (no torch, no OpenVINO): safe to import eagerly for annotations.
from engine.serve.interface import Engine, EngineError, EngineInfo

__all__ = ["Engine", "EngineError", "EngineInfo", "open_engine", "list_demo_models"]

Progress = Callable[[str, float], None]  # (what is happening, fraction 0..1)


def open_engine(spec: str = "demo", device: str = "CPU", progress: Progress | None = None) -> Engine:
    """Open a local engine for `spec` (a demo id, a model folder or a hub id).

    Blocking and slow (it may build a demo model and compile it): call it off
    the GUI thread. `progress` is called from that same thread.
    """
    from engine.serve.local import LocalEngine  # lazy: pulls in torch/OpenVINO

    return LocalEngine.from_spec(spec, device=device, progress=progress)


def list_demo_models() -> list[str]:
    """The demo model ids, in the order the UI should offer them."""
    from engine.models.demo import demo_ids

    return list(demo_ids())
