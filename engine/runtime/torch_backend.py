"""The transformers reference backend: eager PyTorch with a DynamicCache per
stream. Slow but simple; tests compare the OpenVINO backend against it, and
users can pick it with backend="torch" (e.g. to rule out an export problem).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from engine.runtime.backend import Progress
from engine.runtime.errors import BackendError

PRECISIONS = {"default": "float32", "f32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class TorchConfig:
    device: str = "CPU"  # only "CPU" (torch is installed CPU-only)
    precision: str = "default"  # "default"/"f32" = float32 weights, "bf16" = bfloat16


class TorchStream:
    def __init__(self, model) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.past = 0  # tokens in the cache

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
        self.past += n
        return out.logits[0, -1].float().numpy().astype(np.float32, copy=True)  # [vocab]

    def decode(self, token: int) -> np.ndarray:
        return self.prefill([token])

    def close(self) -> None:
        self.cache = None


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
