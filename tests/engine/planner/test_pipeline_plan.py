"""The pure partition planner on hand-built fleets."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.planner.plan import (
    DEFAULT_LINK,
    LOOPBACK_LINK,
    DeviceProfile,
    LinkProfile,
    PeerProfile,
    Plan,
    PlanError,
    PlanModel,
    PlanRequest,
    auto_plan,
)
from engine.planner.issues import gb
from engine.planner.peers import link_between, links_from_list, links_to_list
from engine.planner.validate import (
    evaluate_plan,
    exclude_peer,
    move_boundary,
    pin_device,
    validate_plan,
)

GB = 10**9


def bare(**kw):
    """A request without reserves; KV at 1 byte per element, so `kv` below is bytes too."""
    return PlanRequest(**{"context_length": 1, "streams": 1, "kv_dtype_bytes": 1.0, "runtime_reserve_bytes": 0,
                          "prefill_chunk": 0, "os_reserve_bytes": 0, **kw})


BARE = bare()
BF16 = bare(weight_precision="bf16")  # the checkpoint's own precision, never "auto"


def model(n=8, layer=GB, emb=0, head=0, kv=0, hidden=1024, name="demo", dtype=2):
    return PlanModel(name, n, hidden, tuple([layer] * n), emb, head, kv, dtype_bytes=dtype)


def peer(pid, ram, bw=40e9, kind="CPU", ms=None, devices=None):
    devs = devices or (DeviceProfile(kind, kind, ms, bw),)
    return PeerProfile(pid, pid, tuple(devs), int(ram))


def layers(plan):
    return {s.peer_id: s.end - s.start for s in plan.stages}


def covers(plan, n):
    starts = [s.start for s in plan.stages]
    ends = [s.end for s in plan.stages]
    return starts[0] == 0 and ends[-1] == n and starts[1:] == ends[:-1] and all(
        s.end > s.start for s in plan.stages)


# ---------------------------------------------------------------- balancing
def test_two_equal_peers_split_evenly():
    for n in (8, 12):
        plan = auto_plan(model(n), [peer("a", 100 * GB), peer("b", 100 * GB)], BARE)
        assert [s.end - s.start for s in plan.stages] == [n // 2, n // 2]
        assert covers(plan, n) and plan.fits


def test_twice_as_fast_peer_gets_twice_the_layers():
    plan = auto_plan(model(12), [peer("fast", 100 * GB, 80e9), peer("slow", 100 * GB, 40e9)], BARE)
    assert layers(plan) == {"fast": 8, "slow": 4}
    # Compute per stage: 8 GB / 80 GB/s = 4 GB / 40 GB/s = 100 ms.
    assert [round(s.compute_ms, 6) for s in plan.stages] == [100.0, 100.0]


def test_calibrated_time_replaces_the_bandwidth_estimate():
    # 10 ms per layer measured on "meas" vs 25 ms per layer estimated (1 GB at 40 GB/s).
    peers = [peer("meas", 100 * GB, ms=10.0), peer("est", 100 * GB, 40e9)]
    plan = auto_plan(model(7), peers, BARE)
    assert layers(plan) == {"meas": 5, "est": 2}
    st0 = next(s for s in plan.stages if s.peer_id == "meas")
    assert st0.compute_ms == pytest.approx(50.0)


def test_fast_peer_with_little_memory_gets_fewer_layers():
    plan = auto_plan(model(12), [peer("fast", 3 * GB, 200e9), peer("slow", 100 * GB, 40e9)], BARE)
    assert layers(plan) == {"fast": 3, "slow": 9}
    assert plan.fits and all(s.total_bytes <= s.ram_free_bytes for s in plan.stages)


def test_embeddings_on_first_stage_and_head_on_last():
    m = model(8, emb=GB // 2, head=GB // 4)
    plan = auto_plan(m, [peer("a", 100 * GB), peer("b", 100 * GB)], BARE)
    first, last = plan.stages[0], plan.stages[-1]
    assert first.weight_bytes == first.num_layers * GB + GB // 2
    assert last.weight_bytes == last.num_layers * GB + GB // 4
    assert sum(s.weight_bytes for s in plan.stages) == 8 * GB + GB // 2 + GB // 4


def test_gpu_preferred_when_faster_and_pin_respected():
    devs = (DeviceProfile("CPU", "CPU", None, 40e9), DeviceProfile("GPU", "GPU.0", None, 80e9))
    plan = auto_plan(model(4), [peer("a", 100 * GB, devices=devs)], BARE)
    assert plan.stages[0].device == "GPU.0"
    cpu_only = auto_plan(model(4), [peer("a", 100 * GB, devices=devs)], BARE, device_preference=("CPU",))
    assert cpu_only.stages[0].device == "CPU"
    pinned = auto_plan(model(4), [peer("a", 100 * GB, devices=devs)], BARE, pinned_devices={"a": "CPU"})
    assert pinned.stages[0].device == "CPU"


# ---------------------------------------------------------------- memory
def infeasible_setup():
    m = model(8, emb=GB // 2, head=GB // 2, kv=100_000)
    peers = [peer("a", 4 * GB), peer("b", 4 * GB)]
    return m, peers, bare(context_length=1000, runtime_reserve_bytes=GB // 2, weight_precision="bf16")


def test_infeasible_fleet_says_needed_and_available():
    m, peers, req = infeasible_setup()
    with pytest.raises(PlanError) as e:
        auto_plan(m, peers, req)
    assert str(e.value) == ("demo at bf16 needs 10.3 GB on 2 peers (weights 8.5 GB + KV 0.8 GB + runtime and "
                            "OS reserves 1.0 GB; the 0.5 GB embedding is read from the mapped file); the fleet "
                            "shares 8.0 GB: 2.3 GB short; it fits with int8 weights or another peer sharing 3.3 GB")
    (issue,) = e.value.issues
    assert (issue.code, issue.stage, issue.shortfall_bytes) == ("fleet_memory", None, int(2.3 * GB))
    weights, extra = issue.hints
    assert (weights.code, weights.weight_precision) == ("weights", "int8")
    assert extra.code == "add_peer" and 3.2 * GB <= extra.ram_bytes <= 3.3 * GB
    # Each hint is true: the change it names makes the plan fit.
    assert auto_plan(m, peers, PlanRequest(**{**req.to_dict(), "weight_precision": "int8"})).fits
    assert auto_plan(m, peers + [peer("new", extra.ram_bytes)], req).fits
    with pytest.raises(PlanError):
        auto_plan(m, peers + [peer("new", extra.ram_bytes - GB // 10)], req)


def test_int4_makes_the_same_fleet_feasible():
    m, peers, req = infeasible_setup()
    plan = auto_plan(m, peers, PlanRequest(**{**req.to_dict(), "weight_precision": "int4"}))
    assert plan.fits and covers(plan, 8) and plan.weight_precision == "int4"
    # Layers: 0.5 byte per weight + an f16 scale per group of 128; embedding and head stay int8.
    layer = GB // 2 // 2 + 2 * (GB // 2 // 128)
    assert sum(s.weight_bytes for s in plan.stages) == 8 * layer + GB // 4 + GB // 4


def test_single_layer_bigger_than_any_peer():
    m = model(2, layer=2 * GB)
    with pytest.raises(PlanError) as e:
        auto_plan(m, [peer(x, 1.5 * GB) for x in "abc"], bare(weight_precision="bf16"))
    assert str(e.value) == ("layer 0 of demo needs 2.0 GB (weights 2.0 GB + KV 0.0 GB + runtime 0.0 GB + "
                            "OS 0.0 GB) but the largest peer (c) shares 1.5 GB: 0.5 GB short; it fits with "
                            "int8 weights or another peer sharing 4.0 GB")
    assert e.value.issues[0].code == "layer_too_big"


def test_per_peer_margins_can_make_a_fleet_too_fragmented():
    # 4 GB of layers + 3 x 0.5 GB runtime <= 6 GB shared, but each peer holds one 1 GB layer only.
    req = bare(runtime_reserve_bytes=GB // 2, weight_precision="bf16")
    with pytest.raises(PlanError, match="no split into contiguous layer ranges") as e:
        auto_plan(model(4), [peer("a", 2 * GB), peer("b", 2 * GB), peer("c", 2 * GB)], req)
    assert e.value.issues[0].code == "fragmented"


def test_no_peers_and_no_devices():
    with pytest.raises(PlanError, match="no peers"):
        auto_plan(model(2), [], BARE)
    with pytest.raises(PlanError, match="no peer offers a device of kind NPU"):
        auto_plan(model(2), [peer("a", 100 * GB)], BARE, device_preference=("NPU",))


def test_streams_and_context_grow_kv_and_change_the_plan():
    m = model(12, kv=131072)
    peers = [peer("fast", 6 * GB, 80e9), peer("slow", 200 * GB, 40e9)]
    small = auto_plan(m, peers, bare(context_length=1024))
    big = auto_plan(m, peers, bare(context_length=4096, streams=8))
    kv_layer_small, kv_layer_big = 131072 * 1024, 131072 * 4096 * 8
    for plan, kvl in ((small, kv_layer_small), (big, kv_layer_big)):
        assert all(s.kv_bytes == kvl * s.num_layers for s in plan.stages)
        assert plan.fits
    assert layers(small)["fast"] == 5  # 5 * (1 GB + 0.13 GB) <= 6 GB < 6 * 1.13 GB
    assert layers(big)["fast"] == 1  # 1 GB + 4.3 GB per layer
    assert big.streams == 8 and big.context_length == 4096


def test_runtime_and_os_reserves_count():
    req = bare(runtime_reserve_bytes=100, runtime_reserve_fraction=0.1, os_reserve_bytes=7)
    st = auto_plan(model(2), [peer("a", 100 * GB)], req).stages[0]
    assert st.runtime_reserve_bytes == 100 + math.ceil(0.1 * 2 * GB) and st.os_reserve_bytes == 7
    assert st.total_bytes == st.weight_bytes - st.mapped_bytes + st.kv_bytes + st.runtime_reserve_bytes + 7
    assert st.margin_bytes == st.runtime_reserve_bytes + 7
    assert st.process_bytes == st.total_bytes - 7  # what the worker process itself holds


def moe_model(n=4, dense=GB // 10, experts=GB // 2, hidden=1024):
    """Layers of `dense` bytes of attention and router plus `experts` bytes of routed experts (bf16)."""
    from engine.planner.memory import WeightCounts

    per = experts // 2  # bf16 elements
    return PlanModel("moe", n, hidden, tuple([dense + experts] * n), 0, 0, 0, dtype_bytes=2,
                     layer_expert_params=tuple([WeightCounts(matrix=per, rows=per // hidden)] * n))


def test_moe_experts_count_twice_on_cpu_once_on_gpu():
    # The CPU plugin ends up holding a second copy of the routed experts (plan_memory.EXPERT_COPIES).
    m = moe_model()
    cpu = evaluate_plan([("a", "CPU", 0, 4)], m, [peer("a", 100 * GB)], BF16).stages[0]
    gpu = evaluate_plan([("a", "GPU", 0, 4)], m, [peer("a", 100 * GB, kind="GPU")], BF16).stages[0]
    assert cpu.weight_bytes == gpu.weight_bytes == 4 * (GB // 10 + GB // 2)  # the shard itself
    assert cpu.runtime_reserve_bytes - gpu.runtime_reserve_bytes == 4 * (GB // 2)  # one more copy of the experts
    # int8 halves the shard and the extra copy alike (plus one scale and zero point per row).
    int8 = evaluate_plan([("a", "CPU", 0, 4)], m, [peer("a", 100 * GB)], bare(weight_precision="int8")).stages[0]
    assert int8.runtime_reserve_bytes == pytest.approx(4 * GB // 4, rel=0.01)
    # A dense model of the same bytes has no such copy.
    dense = evaluate_plan([("a", "CPU", 0, 4)], model(4, layer=GB // 10 + GB // 2), [peer("a", 100 * GB)], BF16)
    assert dense.stages[0].runtime_reserve_bytes == 0


def test_auto_plan_fits_moe_stages_with_their_expert_copies():
    # 4 layers of 0.6 GB on CPU peers of 1.5 GB: by the shard alone two layers a peer would fit
    # (1.2 GB); with the experts' second copy (1 GB more) only one does.
    m = moe_model()
    peers = [peer(p, int(1.5 * GB)) for p in "abcd"]
    plan = auto_plan(m, peers, BF16)
    assert plan.fits and sorted(layers(plan).values()) == [1, 1, 1, 1]
    assert all(s.total_bytes <= s.ram_free_bytes for s in plan.stages)
    two = evaluate_plan([("a", "CPU", 0, 2), ("b", "CPU", 2, 4)], m, peers, BF16)
    assert not two.fits and two.stages[0].total_bytes == 2 * (GB // 10 + GB // 2) + 2 * (GB // 2)
    # The same model round-trips through a dict with its expert counts.
    assert PlanModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_profile_experts_reach_the_plan_model():
    from engine.models.profile import ExpertInfo

    prof = SimpleNamespace(num_layers=2, hidden_size=64, bytes_per_layer=(1000, 1000), embedding_bytes=0,
                           head_bytes=0, dtype_bytes=2, num_kv_heads=2, head_dim=32, model_id="m",
                           experts=ExpertInfo(num_experts=8, top_k=2, bytes_per_expert=2 * 3 * 64 * 16,
                                              shared_expert_bytes=0, moe_layers=(1,)))
    m = PlanModel.from_profile(prof)
    assert m.expert_weight_bytes("bf16") == [0, 8 * 3 * 64 * 16 * 2]  # layer 0 is dense
    assert m.layer_expert_params[1].rows == 8 * (2 * 16 + 64)  # gate + up [16, 64], down [64, 16]


# ---------------------------------------------------------------- links
def test_slow_link_prefers_one_peer_that_holds_everything():
    m = model(8, layer=GB // 10)  # 2.5 ms per layer at 40 GB/s
    peers = [peer("a", 100 * GB), peer("b", 100 * GB)]
    lan = auto_plan(m, peers, BARE)
    assert len(lan.stages) == 2  # 10 ms + 1.1 ms hop beats 20 ms
    slow = auto_plan(m, peers, BARE, links={("a", "b"): LinkProfile(100.0, 1000.0)})
    assert len(slow.stages) == 1 and slow.stages[0].hop_ms < 1e-5  # loopback
    assert slow.bottleneck_ms == pytest.approx(20.0)


def test_ties_go_to_fewer_peers():
    # One peer: 2 layers at 40 GB/s = 50 ms (+ a loopback hop of 6.4e-7 ms). Two peers:
    # b at 20 GB/s runs 1 layer in 50 ms over a near-free link: 1e-8 better, a tie.
    m = model(2)
    peers = [peer("a", 100 * GB, 40e9), peer("b", 100 * GB, 20e9), peer("c", 100 * GB, 20e9)]
    links = {("a", "b"): LinkProfile(0.0, 1e9), ("a", "c"): LinkProfile(0.0, 1e9)}
    plan = auto_plan(m, peers, BARE, links=links)
    assert plan.peer_ids == ("a",)
    two = evaluate_plan([("a", "CPU", 0, 1), ("b", "CPU", 1, 2)], m, peers, BARE, links)
    assert two.bottleneck_ms < plan.bottleneck_ms <= two.bottleneck_ms * (1 + 1e-6)


def test_link_lookup_defaults():
    links = {("a", "b"): LinkProfile(5.0, 100.0)}
    assert link_between(links, "a", "b") == link_between(links, "b", "a") == LinkProfile(5.0, 100.0)
    assert link_between(links, "a", "c") == DEFAULT_LINK == LinkProfile(1.0, 1000.0)
    assert link_between(links, "a", "a") == LOOPBACK_LINK
    # 1 ms + 4096 B * 8 / 1000 Mbit/s
    assert DEFAULT_LINK.transfer_ms(4096) == pytest.approx(1.0 + 0.032768)


def test_throughput_formulas():
    req = bare(streams=2)
    plan = auto_plan(model(8), [peer("a", 100 * GB), peer("b", 100 * GB)], req)
    times = [s.predicted_ms_per_token for s in plan.stages]
    assert plan.cycle_ms == pytest.approx(sum(times))
    assert plan.bottleneck_ms == max(times)
    assert plan.predicted_tok_s == pytest.approx(1000 / sum(times))
    assert plan.predicted_aggregate_tok_s == pytest.approx(1000 / max(times))  # streams >= stages
    one = evaluate_plan(plan, model(8), [peer("a", 100 * GB), peer("b", 100 * GB)], BARE)
    assert one.predicted_aggregate_tok_s == pytest.approx(one.predicted_tok_s)
    for s in plan.stages:
        assert s.predicted_ms_per_token == pytest.approx(s.compute_ms + s.hop_ms)
        assert s.predicted_tok_s == pytest.approx(1000 / s.predicted_ms_per_token)


# ---------------------------------------------------------------- validation
M12 = model(12)
FLEET = [peer("a", 100 * GB), peer("b", 100 * GB),
         PeerProfile("l2", "laptop-2", (DeviceProfile("CPU", "CPU"), DeviceProfile("GPU", "GPU.0")),
                     8 * GB)]


def issues(stages):
    return [(i.stage, i.code, i.message) for i in validate_plan(stages, M12, FLEET, BF16)]


def test_valid_plan_has_no_issues():
    assert issues([("a", "CPU", 0, 6), ("b", "CPU", 6, 12)]) == []
    assert validate_plan(auto_plan(M12, FLEET, BARE), M12, FLEET, BARE) == []


def test_validation_messages():
    assert issues([]) == [(None, "empty_plan", "the plan has no stages: add at least one peer")]
    assert issues([("a", "CPU", 0, 12), ("b", "CPU", 10, 12)])[0] == (
        1, "overlap", "stage 1 starts at layer 10 but stage 0 ends at 12")
    assert issues([("a", "CPU", 0, 5), ("b", "CPU", 6, 12)]) == [
        (1, "gap", "stage 1 starts at layer 6 but stage 0 ends at 5")]
    assert issues([("a", "CPU", 2, 12)]) == [
        (0, "gap", "stage 0 starts at layer 2 but the first stage must start at layer 0")]
    assert issues([("a", "CPU", 0, 10)]) == [
        (0, "gap", "stage 0 ends at layer 10 but the model has 12 layers: layers 10–12 have no stage")]
    assert issues([("a", "CPU", 0, 6), ("b", "CPU", 6, 6), ("l2", "CPU", 6, 12)]) == [
        (1, "empty_range", "stage 1 has no layers: it starts at layer 6 and ends at 6")]
    assert issues([("a", "CPU", 0, 14)]) == [
        (0, "out_of_range", "stage 0 covers layers 0–14 but the model has layers 0–12 "
                            "(layer 14 is out of range)")]
    assert issues([("a", "CPU", 0, 6), ("ghost", "CPU", 6, 12)]) == [
        (1, "unknown_peer", "stage 1 uses unknown peer ghost")]
    assert issues([("a", "CPU", 0, 6), ("a", "CPU", 6, 12)]) == [
        (1, "duplicate_peer", "stage 1 uses peer a again (it already runs stage 0)")]
    assert issues([("a", "CPU", 0, 6), ("l2", "NPU", 6, 12)]) == [
        (1, "unknown_device", "stage 1: peer laptop-2 has no device NPU (it has CPU, GPU.0)")]
    assert issues([("a", "CPU", 0, 3), ("l2", "GPU.0", 3, 12)]) == [
        (1, "memory", "peer laptop-2 needs 9.0 GB for layers 3–12 but shares 8.0 GB (weights 9.0 GB + "
                      "KV 0.0 GB + runtime 0.0 GB + OS 0.0 GB): 1.0 GB short; it fits with int8 weights "
                      "or another peer sharing 1.0 GB for layers 11–12")]
    assert issues([("a", "CPU", 0, 6, 1)])[0][1] == "malformed"


def test_evaluate_plan_rejects_structure_but_flags_memory():
    with pytest.raises(PlanError, match="stage 1 starts at layer 6 but stage 0 ends at 5") as e:
        evaluate_plan([("a", "CPU", 0, 5), ("b", "CPU", 6, 12)], M12, FLEET, BARE)
    assert e.value.issues[0].code == "gap"
    plan = evaluate_plan([("a", "CPU", 0, 3), ("l2", "GPU.0", 3, 12)], M12, FLEET, BF16)
    assert not plan.fits and [s.fits for s in plan.stages] == [True, False]
    # "auto" evaluates the user's stages at the most precise weights at which they fit.
    auto = evaluate_plan([("a", "CPU", 0, 3), ("l2", "GPU.0", 3, 12)], M12, FLEET, BARE)
    assert auto.fits and auto.weight_precision == "int8"
    assert validate_plan([("a", "CPU", 0, 3), ("l2", "GPU.0", 3, 12)], M12, FLEET, BARE) == []


# ---------------------------------------------------------------- editing
def test_move_boundary():
    plan = auto_plan(M12, FLEET[:2], BARE)
    moved = move_boundary(plan, 0, 4, M12, FLEET[:2], BARE)
    assert [(s.start, s.end) for s in moved.stages] == [(0, 4), (4, 12)]
    assert moved.bottleneck_ms > plan.bottleneck_ms
    with pytest.raises(PlanError, match="boundary 0 must stay between layers 1 and 11"):
        move_boundary(plan, 0, 12, M12, FLEET[:2], BARE)
    with pytest.raises(PlanError, match="boundary 1 does not exist"):
        move_boundary(plan, 1, 5, M12, FLEET[:2], BARE)


def test_exclude_peer_replans_on_the_rest():
    plan = auto_plan(M12, FLEET, BARE)
    assert "a" in plan.peer_ids
    rest = exclude_peer(plan, "a", M12, FLEET, BARE)
    assert "a" not in rest.peer_ids and covers(rest, 12) and rest.fits
    with pytest.raises(PlanError, match="unknown peer zz"):
        exclude_peer(plan, "zz", M12, FLEET, BARE)


def test_pin_device():
    plan = auto_plan(M12, FLEET, BARE)
    assert dict(zip(plan.peer_ids, [s.device for s in plan.stages]))["l2"] == "GPU.0"
    cpu = pin_device(plan, "l2", "CPU", M12, FLEET, BARE)
    assert [(s.start, s.end) for s in cpu.stages] == [(s.start, s.end) for s in plan.stages]
    assert dict(zip(cpu.peer_ids, [s.device for s in cpu.stages]))["l2"] == "CPU"
    rebal = pin_device(plan, "l2", "CPU", M12, FLEET, BARE, rebalance=True)
    assert covers(rebal, 12) and all(
        s.device == "CPU" for s in rebal.stages if s.peer_id == "l2")
    with pytest.raises(PlanError, match="no device NPU"):
        pin_device(plan, "l2", "NPU", M12, FLEET, BARE)


# ---------------------------------------------------------------- data
def test_json_round_trips():
    m = model(6, emb=3, head=5, kv=7)
    plan = auto_plan(m, FLEET, BARE)
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert PlanModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    for p in FLEET:
        assert PeerProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    req = PlanRequest(context_length=77, streams=3, kv_dtype_bytes=1, weight_precision="int8")
    assert PlanRequest.from_dict(json.loads(json.dumps(req.to_dict()))) == req
    links = {("a", "b"): LinkProfile(3, 50), ("b", "c"): LinkProfile(0.5, 10000.0)}
    assert links_from_list(json.loads(json.dumps(links_to_list(links)))) == links
    with pytest.raises(ValueError, match="unknown field"):
        PlanRequest.from_dict({"context_length": 5, "bogus": 1})
    with pytest.raises(ValueError, match="streams must be >= 1"):
        PlanRequest.from_dict({"streams": 0})


def test_from_profile_adapter():
    prof = SimpleNamespace(model_id="tiny", architecture="LlamaForCausalLM", num_layers=4,
                           hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=100,
                           dtype_bytes=2, bytes_per_layer=(10, 10, 12, 12), embedding_bytes=5,
                           head_bytes=6, total_bytes=55, max_context=128, experts=None)
    m = PlanModel.from_profile(prof)
    assert (m.model_id, m.num_layers, m.bytes_per_layer, m.embedding_bytes, m.head_bytes) == (
        "tiny", 4, (10, 10, 12, 12), 5, 6)
    assert m.kv_elements_per_token_per_layer == 2 * 2 * 16  # K and V of 2 heads x 16
    assert (m.head_dim, m.num_heads, m.max_context, m.checkpoint_precision) == (16, 4, 128, "bf16")
    assert m.activation_bytes_per_token == 64 * 4
    assert PlanModel.from_profile(vars(prof)) == m


def test_kv_dtype_and_precision_scale_bytes():
    m = model(2, kv=1000)  # fp16 profile: 1000 KV elements per token and layer
    req = bare(context_length=10, kv_dtype_bytes=3, weight_precision="int8")
    plan = auto_plan(m, [peer("a", 100 * GB)], req)
    assert plan.stages[0].kv_bytes == 2 * 1000 * 10 * 3
    assert plan.stages[0].weight_bytes == GB  # 2 layers * 1 GB * 1/2


def test_deterministic_and_independent_of_peer_order():
    peers = [peer("c", 5 * GB, 50e9), peer("a", 7 * GB, 40e9), peer("b", 9 * GB, 40e9),
             peer("d", 4 * GB, 60e9)]
    m = model(16, emb=GB // 3, head=GB // 3)
    first = auto_plan(m, peers, BARE)
    assert auto_plan(m, peers, BARE) == first
    assert auto_plan(m, list(reversed(peers)), BARE) == first


def test_many_peers_use_the_greedy_order():
    peers = [peer(f"p{i}", 3 * GB, 40e9 + i * 1e9) for i in range(9)]
    plan = auto_plan(model(24), peers, BARE)
    assert covers(plan, 24) and plan.fits and len(plan.stages) == 9
    assert plan.stages[0].peer_id == "p8"  # fastest first


def test_big_model_is_quick():
    import time

    peers = [peer(f"p{i}", (20 + i) * GB, (40 + 5 * i) * 1e9) for i in range(6)]
    t = time.perf_counter()
    plan = auto_plan(model(80, layer=GB // 2), peers, BARE)
    assert covers(plan, 80) and plan.fits
    assert time.perf_counter() - t < 20


def test_gb_format():
    assert gb(41_249_999_999) == "41.2 GB" and gb(0) == "0.0 GB"


# ---------------------------------------------------------------- property
def even_specs(n, peers, plan_devices):
    k = len(peers)
    cuts = [round(i * n / k) for i in range(k + 1)]
    return [(p.peer_id, plan_devices[p.peer_id], cuts[i], cuts[i + 1]) for i, p in enumerate(peers)]


fleets = st.fixed_dictionaries({
    "n": st.integers(1, 12),
    "peers": st.lists(st.tuples(st.integers(1, 30), st.sampled_from([20e9, 40e9, 60e9, 80e9]),
                                st.booleans()), min_size=1, max_size=4),
    "emb": st.integers(0, 2), "kv": st.integers(0, 3), "lat": st.sampled_from([0.1, 1.0, 20.0]),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets)
def test_property_random_fleets(f):
    n = f["n"]
    m = model(n, layer=GB, emb=f["emb"] * GB // 2, head=f["emb"] * GB // 4, kv=f["kv"] * 50_000)
    req = bare(context_length=2000, streams=2, runtime_reserve_bytes=GB // 10, runtime_reserve_fraction=0.02,
               weight_precision="bf16")
    peers = []
    for i, (ram, bw, gpu) in enumerate(f["peers"]):
        devs = (DeviceProfile("CPU", "CPU", None, bw),) + (
            (DeviceProfile("GPU", "GPU.0", None, bw * 1.5),) if gpu else ())
        peers.append(PeerProfile(f"p{i}", f"p{i}", devs, ram * GB // 2))
    links = {(a.peer_id, b.peer_id): LinkProfile(f["lat"], 1000.0) for a in peers for b in peers
             if a.peer_id < b.peer_id}
    try:
        plan = auto_plan(m, peers, req, links=links)
    except PlanError as e:
        assert "GB" in str(e)
        # Nothing fits: in particular no single peer holds the whole model.
        for p in peers:  # on the device the planner picks (a GPU holds the embedding, a CPU maps it)
            dev = "GPU.0" if p.device("GPU.0") else "CPU"
            ok = validate_plan([(p.peer_id, dev, 0, n)], m, peers, req) == []
            assert not ok
        return
    assert covers(plan, n) and plan.fits
    assert all(s.total_bytes <= s.ram_free_bytes for s in plan.stages)
    assert validate_plan(plan, m, peers, req) == []
    assert auto_plan(m, peers, req, links=links) == plan
    if len(peers) <= n:
        devices = {p.peer_id: ("GPU.0" if p.device("GPU.0") else "CPU") for p in peers}
        even = evaluate_plan(even_specs(n, peers, devices), m, peers, req, links)
        if even.fits:
            assert plan.bottleneck_ms <= even.bottleneck_ms * (1 + 1e-6)


def brute_force(m, peers, req, links, devices):
    """(bottleneck, peers used) of the best plan, by trying every ordered subset and split."""
    from itertools import combinations, permutations

    n, best = m.num_layers, (math.inf, 0)
    for k in range(1, min(n, len(peers)) + 1):
        for order in permutations(peers, k):
            for cuts in combinations(range(1, n), k - 1):
                b = (0, *cuts, n)
                specs = [(p.peer_id, devices[p.peer_id], b[i], b[i + 1]) for i, p in enumerate(order)]
                plan = evaluate_plan(specs, m, peers, req, links)
                if plan.fits and plan.bottleneck_ms < best[0] * (1 - 1e-6):
                    best = (plan.bottleneck_ms, k)
    return best


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.lists(st.tuples(st.integers(1, 12), st.sampled_from([20e9, 40e9, 70e9]),
                                             st.sampled_from([0.5, 2.0, 30.0])), min_size=1, max_size=3))
def test_property_matches_brute_force(n, spec):
    m = model(n, layer=GB, emb=GB // 2, head=GB // 3, kv=30_000)
    req = bare(context_length=1000, runtime_reserve_bytes=GB // 10, weight_precision="bf16")
    peers = [peer(f"p{i}", ram * GB // 2, bw) for i, (ram, bw, _) in enumerate(spec)]
    links = {(f"p{i}", f"p{j}"): LinkProfile(spec[i][2] + spec[j][2], 1000.0)
             for i in range(len(spec)) for j in range(len(spec)) if i < j}
    best, k = brute_force(m, peers, req, links, {p.peer_id: "CPU" for p in peers})
    if math.isinf(best):
        with pytest.raises(PlanError):
            auto_plan(m, peers, req, links=links)
        return
    plan = auto_plan(m, peers, req, links=links)
    assert plan.bottleneck_ms == pytest.approx(best, rel=1e-6)
    assert len(plan.stages) <= k
