from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_folder() -> Path:
    from engine.models.demo import ensure_demo

    return ensure_demo("demo")


@pytest.fixture(scope="module")
def demo_engine_f32(demo_folder):
    from engine.scheduler.loop import LocalEngine

    engine = LocalEngine(demo_folder, "demo", precision="f32")
    yield engine
    engine.close()
