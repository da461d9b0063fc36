"""The local runner's weight precision: "auto" resolves to the most precise that fits,
from the checkpoint's own dtype down, and the shards are exported at the plan's precision."""

from __future__ import annotations

import dataclasses

import pytest

from engine.pipeline import runner
from engine.planner.plan import PlanError, PlanModel, precision_ladder


@pytest.fixture(scope="module")
def demo_model(demo_dir) -> PlanModel:
    from engine.models import profile_model, resolve_model

    demo_dir("demo")
    return PlanModel.from_profile(profile_model(resolve_model("demo")))


def _cfg(weights: str, budget: int) -> runner.FleetConfig:
    return runner.FleetConfig(stages=2, weights=weights, ram_budget_bytes=budget, max_concurrent=1)


def _least_budget(model: PlanModel, weights: str) -> int:
    """The smallest RAM budget (to 1 MB) at which the demo's 2-stage split fits at `weights`."""
    def fits(budget: int) -> bool:
        try:
            runner.plan_local(model, _cfg(weights, budget), 256)
            return True
        except PlanError:
            return False

    lo, hi = 0, 1 << 40
    assert fits(hi)
    while hi - lo > 1_000_000:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


@pytest.mark.parametrize("checkpoint, wanted", [
    ("f32", "fp16"),  # an f32 checkpoint that does not fit at f32 halves to fp16
    ("bf16", "int8"),  # a bf16 one goes to int8: fp16 is no smaller than bf16
])
def test_auto_is_the_most_precise_that_fits(demo_model, checkpoint, wanted):
    model = dataclasses.replace(demo_model, checkpoint_precision=checkpoint)
    ladder = precision_ladder(checkpoint)
    above = ladder[ladder.index(wanted) - 1]
    need, need_above = _least_budget(model, wanted), _least_budget(model, above)
    assert need < need_above
    plan = runner.plan_local(model, _cfg("auto", (need + need_above) // 2), 256)
    assert plan.fits and plan.weight_precision == wanted
    # With room for the checkpoint as it is, nothing is lost.
    assert above == checkpoint
    assert runner.plan_local(model, _cfg("auto", need_above), 256).weight_precision == checkpoint


def test_auto_keeps_the_checkpoints_own_dtype_when_it_fits(demo_model):
    for checkpoint in ("f32", "bf16", "fp16"):
        model = dataclasses.replace(demo_model, checkpoint_precision=checkpoint)
        plan = runner.plan_local(model, _cfg("auto", 1 << 40), 256)
        assert plan.weight_precision == checkpoint


def test_a_split_that_fits_nowhere_says_auto_tried_every_precision(demo_model):
    model = dataclasses.replace(demo_model, checkpoint_precision="bf16")
    with pytest.raises(PlanError) as e:
        runner.plan_local(model, _cfg("auto", 1000), 256)
    assert "even with int4 weights (auto tried bf16, int8, int4)" in str(e.value)
    assert "stage 0:" in str(e.value) and "stage 1:" in str(e.value)
    with pytest.raises(PlanError, match="weight precision 'q3' is not one of auto, f32") as bad:
        runner.plan_local(demo_model, _cfg("q3", 1 << 40), 256)
    assert [i.code for i in bad.value.issues] == ["bad_weights"]


def test_shards_are_exported_at_the_plans_precision(monkeypatch, demo_dir, tmp_path):
    import engine.shards.export as export

    demo_dir("demo")
    asked: list[tuple] = []

    def ensure_shard(model_path, start, end, *, num_layers_total=None, precision="f32", **_kw):
        asked.append((start, end, precision))
        return f"shard {start}-{end}"

    monkeypatch.setattr(export, "ensure_shard", ensure_shard)
    monkeypatch.setattr(runner.tempfile, "tempdir", str(tmp_path))  # where its log folder would go
    fleet = runner.LocalFleet(runner.FleetConfig(model="demo", split=((0, 3), (3, 8)), weights="int4",
                                                 max_concurrent=1, context_length=256))
    assert fleet.plan.weight_precision == "int4" and fleet.checkpoint == "f32"
    assert fleet.export() == ["shard 0-3", "shard 3-8"]
    assert asked == [(0, 3, "int4"), (3, 8, "int4")]
    # planned and exported, no worker launched: no log folder yet (nothing to remove if it is never stopped)
    # (torch may put its own compile cache there when it first compiles: not ours to count)
    assert fleet.log_dir is None and list(tmp_path.glob("flotilla-pipeline-*")) == []
    fleet.stop()
    assert list(tmp_path.glob("flotilla-pipeline-*")) == []


def test_even_split_covers_every_layer_once():
    assert runner.even_split(8, 2) == ((0, 4), (4, 8))
    assert runner.even_split(7, 3) == ((0, 3), (3, 5), (5, 7))
    with pytest.raises(PlanError):
        runner.even_split(3, 4)


def test_the_exact_prompt_cache_plans_the_stages_kv_at_16_bits(demo_model):
    """Its workers keep an f16 KV cache (prompt_cache.EXACT_CACHE_KV): the plan counts 2 bytes an element,
    where the default u8 cache costs 1 plus its scales and grows by doubling (KV_U8_GROWTH)."""
    from engine.planner.memory import KV_U8_GROWTH, kv_element_bytes

    cfg = dataclasses.replace(_cfg("auto", 1 << 40), max_concurrent=2)
    plain = runner.plan_local(demo_model, cfg, 256)
    exact = runner.plan_local(demo_model, dataclasses.replace(cfg, prompt_cache_exact=True), 256)
    u8 = kv_element_bytes("CPU", head_dim=demo_model.head_dim)
    for a, b in zip(plain.stages, exact.stages):
        assert a.kv_bytes > 0
        assert b.kv_bytes == pytest.approx(a.kv_bytes * 2.0 / (u8 * KV_U8_GROWTH), rel=0.01)
