"""Fixtures of the engine tests: a persistent model cache and reference helpers.

FLOTILLA_CACHE is reused when set (fast); otherwise it points at
<repo>/.cache/flotilla (as tests/conftest.py does) so repeated runs reuse demo builds and exports.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("FLOTILLA_CACHE", str(REPO / ".cache" / "flotilla"))

@pytest.fixture(scope="session")
def flotilla_cache() -> Path:
    return Path(os.environ["FLOTILLA_CACHE"])


@pytest.fixture(scope="session")
def demo_dir(flotilla_cache):
    """demo_dir(name) -> the built demo model folder (built once)."""
    from engine.models.demo import ensure_demo

    return ensure_demo


@pytest.fixture(scope="module")
def demo_engine():
    """The real local engine (what `--engine local`, the default, opens: the paged engine) on
    the `demo` model, OpenVINO in f32 (greedy answers are then reproducible and equal
    transformers'), one per test module."""
    from engine.local.factory import EngineOptions, open_engine

    eng = open_engine("demo", "local", EngineOptions(precision="f32"))
    try:
        yield eng
    finally:
        eng.close()
