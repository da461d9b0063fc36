"""Suite-wide settings: no hub, one shared model cache, no display needed."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Tests never reach a model hub; demo models are built locally from configs.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# The same cache as `make run`/`make test`, so models are built once per checkout.
os.environ.setdefault("FLOTILLA_CACHE", str(REPO / ".cache" / "flotilla"))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
