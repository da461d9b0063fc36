"""Shared fixtures of the serve tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def demo_engine():
    """The real LocalEngine on the `demo` model, OpenVINO in f32 (greedy answers are then
    reproducible and equal transformers'), one per test module."""
    from engine.serve.local import LocalEngine

    eng = LocalEngine.from_spec("demo", precision="f32")
    try:
        yield eng
    finally:
        eng.close()
