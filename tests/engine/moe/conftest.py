"""Fixtures of the MoE engine tests: tiny MoE models and their expert stores (built once)."""

from __future__ import annotations

import pytest

from engine.moe.recipes import TINY_MIXTRAL, TINY_OLMOE, TINY_QWEN3_MOE

ARCHS = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe")


def _model_dir(arch: str):
    from engine.models.demo import ensure_demo, ensure_recipe

    if arch == "qwen2_moe":
        return ensure_demo("demo-moe")
    return ensure_recipe({"mixtral": TINY_MIXTRAL, "olmoe": TINY_OLMOE, "qwen3_moe": TINY_QWEN3_MOE}[arch])


@pytest.fixture(scope="session")
def moe_model():
    """moe_model(arch) -> (HF model folder, expert store folder)."""
    from engine.models.ref import resolve_model
    from engine.moe.convert import ensure_store

    made = {}

    def get(arch: str):
        if arch not in made:
            path = _model_dir(arch)
            fp = resolve_model(str(path)).fingerprint
            made[arch] = (path, ensure_store(path, fp))
        return made[arch]

    return get
