"""The planner on config-only profiles of real models (Llama-3.1-70B and 8B, their
config.json in configs/): the plans a user of office PCs gets, and why fp16 fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.models.profile import DEFAULT_CONTEXT, profile_model
from engine.planner.plan import (DeviceProfile, PeerProfile, PlanError, PlanModel, PlanRequest, auto_plan,
                                  choose_precision, kv_element_bytes, os_reserve, weight_bytes_of)
from engine.planner.validate import validate_plan

CONFIGS = Path(__file__).with_name("configs")
GB = 10**9


def peers(n, free_gb, total_gb=None):
    return [PeerProfile(f"p{i}", f"pc-{i}", (DeviceProfile("CPU", "CPU"),), int(free_gb * GB),
                        int((total_gb or free_gb) * GB)) for i in range(n)]


@pytest.fixture(scope="module")
def llama70():
    return PlanModel.from_profile(profile_model(CONFIGS / "llama-3.1-70b"))


@pytest.fixture(scope="module")
def llama8():
    return PlanModel.from_profile(profile_model(CONFIGS / "llama-3.1-8b"))


def test_config_only_profiles_match_the_published_sizes():
    p70, p8 = profile_model(CONFIGS / "llama-3.1-70b"), profile_model(CONFIGS / "llama-3.1-8b")
    # 70.55 B and 8.03 B parameters in bf16, as the checkpoints on the hub.
    assert p70.total_bytes == pytest.approx(141.1e9, rel=2e-3) and p70.dtype == "bf16"
    assert p8.total_bytes == pytest.approx(16.06e9, rel=2e-3) and p8.dtype == "bf16"
    assert (p70.num_layers, p70.num_kv_heads, p70.head_dim, p70.max_context) == (80, 8, 128, 131072)
    assert p8.kv_elements_per_token == 2 * 32 * 8 * 128
    # A layer: q, o [4096, 4096]; k, v [1024, 4096]; gate, up [14336, 4096]; down [4096, 14336]; 2 norms.
    layer = p8.layer_params[0]
    assert layer.matrix == 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096
    assert (layer.rows, layer.vector) == (4096 * 2 + 1024 * 2 + 14336 * 2 + 4096, 2 * 4096)
    assert p8.layer_tail_params.matrix == 4096 * 14336  # down_proj ends a shard's graph


def test_default_context_is_what_a_user_picks_not_the_128k_maximum(llama8):
    plan = auto_plan(llama8, peers(2, 8, 16), PlanRequest(weight_precision="int4"))
    assert plan.context_length == DEFAULT_CONTEXT == 4096
    longer = auto_plan(llama8, peers(2, 8, 16), PlanRequest(weight_precision="int4", context_length=16384))
    assert longer.context_length == 16384
    assert sum(s.kv_bytes for s in longer.stages) == pytest.approx(4 * sum(s.kv_bytes for s in plan.stages), rel=1e-6)


def test_the_apps_default_request_plans_the_one_default_context(llama8):
    """The facade the app plans through leaves the context to the planner (it once sent a
    literal 4096 of its own): one default, engine.models.profile.DEFAULT_CONTEXT."""
    from engine import client

    request = client.plan_request(weight_precision="int4")
    assert request.context_length is None
    assert auto_plan(llama8, peers(2, 8, 16), request).context_length == DEFAULT_CONTEXT


def test_70b_over_four_32gb_peers(llama70):
    fleet = peers(4, 32)
    int4 = auto_plan(llama70, fleet, PlanRequest(weight_precision="int4"))
    assert int4.fits and len(int4.stages) == 4 and validate_plan(int4, llama70, fleet, PlanRequest()) == []
    # 68.5 B layer weights at 0.516 byte + embedding and head at 1 byte (int8) + 3 int8 down projections
    assert sum(s.weight_bytes for s in int4.stages) == pytest.approx(37.7e9, rel=0.01)
    for s in int4.stages:
        assert s.os_reserve_bytes == os_reserve(32 * GB) == int(3.2 * GB)
        assert s.total_bytes == (s.weight_bytes - s.mapped_bytes + s.kv_bytes + s.runtime_reserve_bytes
                                 + s.os_reserve_bytes)
    # Stage 0's int8 embedding (one scale + zero point per row) stays in the mapped file on a CPU
    assert [s.mapped_bytes for s in int4.stages] == [128256 * 8192 + 3 * 128256, 0, 0, 0]
    label, auto = choose_precision(llama70, fleet, PlanRequest())
    assert label == auto.weight_precision == "int8" and auto.fits  # bf16 (141 GB) cannot
    with pytest.raises(PlanError) as e:
        auto_plan(llama70, fleet, PlanRequest(weight_precision="fp16"))
    (issue,) = e.value.issues
    assert issue.code == "fleet_memory" and issue.shortfall_bytes > 29 * GB
    # 141.1 GB of fp16 weights, all held but stage 0's 2.1 GB embedding
    assert "weights 139.0 GB" in str(e.value) and "2.1 GB embedding" in str(e.value)
    assert "needs" in str(e.value) and "128.0 GB" in str(e.value)
    hints = {h.code: h for h in issue.hints}
    assert hints["weights"].weight_precision == "int8"
    assert "context" not in hints  # no context makes 141 GB of weights fit in 128 GB
    assert auto_plan(llama70, fleet + [PeerProfile("x", "x", (DeviceProfile("CPU", "CPU"),),
                                                    hints["add_peer"].ram_bytes)],
                     PlanRequest(weight_precision="fp16")).fits


def test_8b_over_two_8gb_peers(llama8):
    fleet = peers(2, 8, 16)  # two 16 GB PCs with 8 GB free each
    int4 = auto_plan(llama8, fleet, PlanRequest(weight_precision="int4"))
    assert int4.fits and len(int4.stages) == 2
    label, auto = choose_precision(llama8, fleet, PlanRequest())
    assert label == "int8" and auto.fits
    with pytest.raises(PlanError) as e:
        auto_plan(llama8, fleet, PlanRequest(weight_precision="fp16"))
    # 16.1 GB of fp16 weights, of which stage 0 holds all but the 1.1 GB embedding (read from the mapped file)
    assert "weights 15.0 GB" in str(e.value) and "1.1 GB embedding" in str(e.value)
    assert "16.0 GB" in str(e.value) and "int8 weights" in str(e.value)


def test_a_stage_too_big_names_itself_the_shortfall_and_computed_fixes(llama8):
    fleet = peers(2, 8, 16)
    specs = [("p0", "CPU", 0, 16), ("p1", "CPU", 16, 32)]
    issues = validate_plan(specs, llama8, fleet, PlanRequest(weight_precision="bf16", streams=4))
    assert [(i.stage, i.code) for i in issues] == [(0, "memory"), (1, "memory")]
    first = issues[0]
    assert first.shortfall_bytes > 0 and f"{first.shortfall_bytes / GB:.1f} GB short" in first.message
    hints = {h.code: h for h in first.hints}
    assert list(hints) == ["weights", "add_peer"]  # in the order a user tries them
    ok = validate_plan(specs, llama8, fleet, PlanRequest(weight_precision=hints["weights"].weight_precision,
                                                         streams=4))
    assert ok == []


def test_context_and_streams_hints_are_the_largest_that_fit(llama8):
    fleet = peers(2, 8, 16)
    req = PlanRequest(weight_precision="int4", context_length=16384, streams=4)
    specs = [("p0", "CPU", 0, 16), ("p1", "CPU", 16, 32)]
    issue = validate_plan(specs, llama8, fleet, req)[0]
    hints = {h.code: h for h in issue.hints}
    ctx, streams = hints["context"].context_length, hints["streams"].streams
    assert validate_plan(specs, llama8, fleet, PlanRequest(weight_precision="int4", context_length=ctx,
                                                           streams=4)) == []
    assert validate_plan(specs, llama8, fleet, PlanRequest(weight_precision="int4", context_length=ctx + 256,
                                                           streams=4)) != []
    assert validate_plan(specs, llama8, fleet, PlanRequest(
        weight_precision="int4", context_length=16384, streams=streams)) == []
    assert validate_plan(specs, llama8, fleet, PlanRequest(
        weight_precision="int4", context_length=16384, streams=streams + 1)) != []


def test_kv_element_bytes_follow_the_runtime():
    assert kv_element_bytes("CPU") == 1 + 8 / 128  # u8 + an f32 scale and zero point per head
    assert kv_element_bytes("CPU", exact=True) == 4.0
    assert kv_element_bytes("GPU") == 2.0
    assert kv_element_bytes("CPU", ir_precision="f16") == 2.0


def test_int4_bytes_per_tensor_kind(llama8):
    from engine.planner.plan import WeightCounts

    w = WeightCounts(matrix=128 * 256, rows=128, vector=64)
    assert weight_bytes_of(w, "int4") == 128 * 256 // 2 + 2 * (128 * 256 // 128) + 4 * 64
    assert weight_bytes_of(w, "int8") == 128 * 256 + 3 * 128 + 4 * 64
    assert weight_bytes_of(w, "int4", int8_backup=True) == weight_bytes_of(w, "int8")
    # The embedding and the head stay int8 under int4; a shard without the head keeps its
    # last layer's down projection int8 too.
    assert llama8.embedding_weight_bytes("int4") == llama8.embedding_weight_bytes("int8")
    assert llama8.tail_extra_bytes("int4") > 0 == llama8.tail_extra_bytes("int8")


@pytest.mark.parametrize("precision", ["int4", "int8", "fp16"])
def test_the_agent_sizes_a_first_stage_as_the_planner_does(llama8, precision):
    """The planner's stage 0 and the agent's start check (from the shard's manifest) count the
    same resident memory: the embedding stays in the mapped file on a CPU, on a GPU it is held."""
    from engine.fleet.policy import start_need

    gpu = PeerProfile("g", "gpu-pc", (DeviceProfile("GPU", "GPU.0"),), 64 * GB, 64 * GB)
    for fleet, kind in ((peers(2, 16), "CPU"), ([gpu, *peers(1, 16)], "GPU")):
        plan = auto_plan(llama8, fleet, PlanRequest(weight_precision=precision, context_length=2048, streams=2))
        s0 = plan.stages[0]
        assert s0.start == 0 and s0.device.startswith(kind)
        table = 128256 * 4096 * (2 if precision == "fp16" else 1) + (0 if precision == "fp16" else 3 * 128256)
        assert s0.mapped_bytes == (table if kind == "CPU" else 0)
        assert all(s.mapped_bytes == 0 for s in plan.stages[1:])
        manifest = {"start": 0, "end": s0.end, "head_dim": 128, "num_kv_heads": 8, "hidden_size": 4096,
                    "vocab_size": 128256, "precision": precision}
        need = start_need(s0.weight_bytes, manifest, s0.device, False, 2048, 2)
        assert need.weights == s0.resident_weight_bytes
        assert need.kv == s0.kv_bytes
