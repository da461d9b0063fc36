"""The small interface every single-machine model backend offers.

A backend holds one loaded model; new_stream() opens a per-request stream with
its own KV state, so requests never see each other's cache. Streams are used
by one thread at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np

Progress = Callable[[str, float], None]  # (message, fraction 0..1)

BACKENDS = ("openvino", "torch")


class ModelStream(Protocol):
    past: int  # tokens already in this stream's KV state
    # (optional) cached: how many of them an earlier request left for this prompt (prompt caching)

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Append ids to the state; return the last position's logits, float32 [vocab]."""

    def decode(self, token: int) -> np.ndarray:
        """Append one token; return its logits, float32 [vocab]."""

    def close(self) -> None:
        """Free the KV state."""


class ModelBackend(Protocol):
    device: str  # where it runs, e.g. "CPU"
    model_dir: Path  # folder holding config.json and the tokenizer

    def new_stream(self, prompt_ids: Sequence[int] = ()) -> ModelStream:
        """A stream for a request with this prompt; a backend with a prompt cache may
        open it with the prompt's first ids already in its KV state (stream.cached)."""

    def close(self) -> None: ...


def load_backend(name: str, model_path: Path, device: str = "CPU", precision: str = "default",
                 progress: Progress | None = None) -> ModelBackend:
    """Open model_path with the named backend ("openvino" or "torch")."""
    if name == "openvino":
        from engine.runtime.ov_backend import OVConfig, OVModel

        return OVModel(Path(model_path), OVConfig(device=device, precision=precision), progress)
    if name == "torch":
        from engine.runtime.torch_backend import TorchConfig, TorchModel

        return TorchModel(Path(model_path), TorchConfig(device=device, precision=precision), progress)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
