"""Models as the app lists, profiles, imports, downloads and converts them (all blocking)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from engine.client._common import Progress
from engine.core.interface import EngineError

if TYPE_CHECKING:
    from engine.models import LocalModelEntry, ModelProfile


def list_demo_models() -> list[str]:
    """The demo model ids, in the order the UI should offer them."""
    from engine.models.demo import demo_ids

    return list(demo_ids())


def list_models() -> list[LocalModelEntry]:
    """engine.models.LocalModelEntry for demos, the HF cache, added folders and
    OpenVINO IR folders. Blocking (reads folder sizes)."""
    from engine.models import list_local_models

    return list_local_models()


def model_profile(spec: str, progress: Progress | None = None) -> ModelProfile:
    """engine.models.ModelProfile (layers, bytes, experts) of a model. Blocking;
    builds an unbuilt demo first."""
    from engine.models import profile_model, resolve_model

    return profile_model(resolve_model(spec, progress, allow_download=False))


def import_model_folder(path: str | Path) -> LocalModelEntry:
    """Validate and remember a model folder; its LocalModelEntry. ModelError if unusable."""
    from engine.models import add_model_folder

    return add_model_folder(path)


class DownloadPaused(EngineError):
    """download_model stopped because the user paused; call again to resume."""


def download_model(hub_id: str, progress: Progress | None = None,
                   pause: threading.Event | None = None) -> Path:
    """Download a hub model into the Hugging Face cache. Blocking. Setting
    `pause` stops at the next progress tick with DownloadPaused; calling again
    resumes (huggingface_hub keeps the partial files). ModelError (a sentence
    for the user) when offline, gated or unknown."""
    from engine.models import resolve_model

    def tick(message: str, fraction: float) -> None:
        if pause is not None and pause.is_set():
            raise DownloadPaused(f"download of {hub_id} paused")
        if progress:
            progress(message, fraction)

    tick(f"contacting the hub for {hub_id}", 0.0)
    return Path(resolve_model(hub_id, tick).path)


def convert_to_openvino(spec: str, progress: Progress | None = None) -> Path:
    """Export a Hugging Face model to an OpenVINO IR folder (cached; the local
    engine then loads it without converting). Blocking. Returns the IR folder."""
    from engine.models import resolve_model
    from engine.runtime.ov_backend import ensure_ir

    report = progress or (lambda _m, _f: None)
    resolved = resolve_model(spec, progress, allow_download=False)
    report(f"converting {resolved.model_id}", 0.05)
    path = ensure_ir(Path(resolved.path), progress=report)
    report(f"OpenVINO IR ready in {path}", 1.0)
    return path
