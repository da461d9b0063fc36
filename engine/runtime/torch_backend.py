"""The transformers reference backend: eager PyTorch with a DynamicCache per
stream. Slow but simple; tests compare the OpenVINO backend against it, and
users can pick it with backend="torch" (e.g. to rule out an export problem).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from engine.runtime.backend import Progress
from engine.runtime.errors import BackendError
from engine.runtime.prompt_cache import KeptStates

PRECISIONS = {"default": "float32", "f32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class TorchConfig:
    device: str = "CPU"  # only "CPU" (torch is installed CPU-only)
    precision: str = "default"  # "default"/"f32" = float32 weights, "bf16" = bfloat16


class TorchStream:
    """One request's DynamicCache. A stream opened on a kept cache (KeptCaches.open) holds its
    first `cached` ids already and prefills only the rest; on close it hands its cache and
    the ids it holds to `release` (the backend's KeptCaches), if it has one. `kv_dtype`
    (e.g. torch.float16): a new cache keeps keys and values at that dtype (torch_kv.py)."""

    def __init__(self, model, cache=None, held: Sequence[int] = (),
                 release: Callable[[Any, list[int]], None] | None = None, kv_dtype: Any = None) -> None:
        from engine.runtime.torch_kv import new_cache

        self.model = model
        self.cache = cache if cache is not None else new_cache(model.config, kv_dtype)
        self.fed: list[int] = list(held)  # the ids whose keys and values the cache holds, in order
        self.cached = len(self.fed)  # of them, taken over from an earlier request (prompt caching)
        self._release = release

    @property
    def past(self) -> int:
        """Tokens in the cache."""
        return len(self.fed)

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        import torch

        n = len(ids)
        if n == 0:
            raise ValueError("prefill needs at least one token")
        x = torch.tensor([list(ids)], dtype=torch.long)  # [1, n]
        pos = torch.arange(self.past, self.past + n, dtype=torch.long)
        with torch.inference_mode():
            out = self.model(input_ids=x, attention_mask=torch.ones(1, self.past + n, dtype=torch.long),
                             position_ids=pos[None],
                             past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.fed.extend(int(t) for t in ids)
        return out.logits[0, -1].float().numpy().astype(np.float32, copy=True)  # [vocab]

    def decode(self, token: int) -> np.ndarray:
        return self.prefill([token])

    def close(self) -> None:
        cache, self.cache = self.cache, None
        if cache is not None and self._release is not None:
            self._release(cache, self.fed)


class KeptCaches:
    """Prompt caching for torch streams: the caches of ended streams, each with the ids it
    holds (prompt_cache.KeptStates). A new stream takes the one sharing the longest prefix
    with its prompt, cut back to that prefix.

    Bounded by the KV reserve: at most `slots` caches exist at once, open or kept (a new
    stream that finds no match pushes the oldest kept one out), so caching costs nothing
    past what `slots` running requests may hold. set_keep(False) keeps none. New caches keep
    their keys and values at `kv_dtype` (None: the activations' dtype)."""

    def __init__(self, model, slots: int, kv_dtype: Any = None) -> None:
        self.model, self.slots, self.keep = model, max(0, int(slots)), True
        self.kv_dtype = kv_dtype
        self._kept: KeptStates[Any] = KeptStates()
        self._open = 0
        self._lock = threading.Lock()  # streams close on the engine's thread; set_keep from any

    def open(self, prompt_ids: Sequence[int] = ()) -> TorchStream:
        with self._lock:
            found = self._kept.take(prompt_ids)
            self._open += 1
            self._kept.drop(len(self._kept) + self._open - self.slots)  # room for this one
        cache, held, reuse = found if found is not None else (None, [], 0)
        if cache is not None:
            try:
                cache.crop(reuse)
            except ValueError:  # a sliding-window layer past its window cannot be cut back
                cache, reuse = None, 0
        return TorchStream(self.model, cache, held[:reuse], self._give_back, self.kv_dtype)

    def set_keep(self, keep: bool) -> None:
        """Keep ended streams' caches from now on, or (False) none: the kept ones go now."""
        with self._lock:
            self.keep = keep
            if not keep:
                self._kept.drop(len(self._kept))

    def _give_back(self, cache: Any, fed: list[int]) -> None:
        with self._lock:
            self._open -= 1
            if self.keep and fed and len(self._kept) + self._open < self.slots:
                self._kept.keep(cache, fed)


class TorchModel:
    def __init__(self, model_path: Path, config: TorchConfig = TorchConfig(),
                 progress: Progress | None = None) -> None:
        if config.device.upper() != "CPU":
            raise BackendError(f"the torch backend runs on CPU only, not {config.device!r}")
        if config.precision not in PRECISIONS:
            raise BackendError(f"unknown precision {config.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if not (Path(model_path) / "config.json").exists() or (Path(model_path) / "openvino_model.xml").exists():
            raise BackendError(f"{model_path} is not a Hugging Face model folder (the torch backend needs one)")
        import torch
        from transformers import AutoModelForCausalLM

        report = progress or (lambda _m, _f: None)
        report("loading the model with transformers", 0.1)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, PRECISIONS[config.precision])).eval()
        self.device = "CPU"
        self.model_dir = Path(model_path)
        report("model ready", 1.0)

    def new_stream(self, prompt_ids: Sequence[int] = ()) -> TorchStream:  # no prompt cache
        return TorchStream(self.model)

    def close(self) -> None:
        self.model = None
