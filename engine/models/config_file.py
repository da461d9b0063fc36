"""The one reader of a model folder's config.json.

Every part that needs a model's numbers (the profiler and planner, the weight-dtype
guess, the sparse and MoE converters, the pipeline's logits width) reads them
through here, so they agree on where the numbers live: a multimodal checkpoint
nests its decoder's under "text_config" (text_config() lifts them, keeping the
top-level "architectures"), and an unreadable file is one ModelError naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.models.errors import ModelError

CONFIG_FILE = "config.json"


def read_config(model_dir: Path | str) -> dict[str, Any]:
    """config.json of a model folder as written; ModelError (one line) when it is missing,
    not JSON or not an object."""
    path = Path(model_dir) / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {path}: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path} is not a JSON object")
    return config


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's numbers: config itself, or its "text_config" when the decoder's numbers
    are nested there (multimodal checkpoints), with the top-level architectures kept."""
    nested = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(nested, dict):
        return {**nested, "architectures": config.get("architectures")}
    return config


def read_text_config(model_dir: Path | str) -> dict[str, Any]:
    """text_config(read_config(model_dir)): the decoder's numbers; ModelError when unreadable."""
    return text_config(read_config(model_dir))


def try_text_config(model_dir: Path | str) -> dict[str, Any]:
    """The decoder's numbers, or {} when the folder has no readable config.json (for
    callers with a default of their own)."""
    try:
        return read_text_config(model_dir)
    except ModelError:
        return {}
