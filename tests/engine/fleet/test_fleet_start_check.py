"""The agent's start check: a worker must fit the owner's RAM cap and free RAM less
the OS reserve with its KV and runtime reserve, not just its shard file."""

from __future__ import annotations

from engine.fleet.policy import MachineState, SharingPolicy, StartNeed, check_start, start_need
from engine.planner.plan import KV_U8_GROWTH, RUNTIME_RESERVE_BYTES, kv_element_bytes, os_reserve

GB = 10**9
# shard.json of layers 16-32 of Llama-3.1-8B (8 KV heads x 128)
MANIFEST = {"start": 16, "end": 32, "num_layers_total": 32, "num_kv_heads": 8, "head_dim": 128,
            "hidden_size": 4096}


def state(avail=12 * GB, total=16 * GB):
    return MachineState(3600.0, True, total, avail, 5.0, 1.7e9)


def test_start_need_counts_kv_at_the_runtime_precision():
    small = start_need(2 * GB, MANIFEST, "CPU", False, 4096, 1)
    assert small.weights == 2 * GB and small.runtime > RUNTIME_RESERVE_BYTES
    per_token = 16 * 2 * 8 * 128  # K + V elements over the shard's 16 layers
    exact = start_need(2 * GB, MANIFEST, "CPU", True, 4096, 1)
    assert exact.kv == per_token * 4096 * kv_element_bytes("CPU", True)  # f32, grows smoothly
    four = start_need(2 * GB, MANIFEST, "CPU", True, 4096, 4)
    assert four.kv == 4 * exact.kv  # each stream its own KV
    assert start_need(2 * GB, None, "CPU", False, 4096, 1) == StartNeed(2 * GB, 0, RUNTIME_RESERVE_BYTES)


def test_start_need_counts_the_kv_precision_the_load_asks_for():
    """The exact prompt cache's 16-bit KV: 2 bytes an element, no u8 scales or doubling growth, and no
    u8 dequantisation scratch; the CPU's default (u8) costs less per element but grows."""
    per_token = 16 * 2 * 8 * 128
    default = start_need(2 * GB, MANIFEST, "CPU", False, 4096, 2)
    f16 = start_need(2 * GB, MANIFEST, "CPU", False, 4096, 2, kv_precision="f16")
    assert f16.kv == per_token * 4096 * 2 * 2
    assert default.kv == int(per_token * 4096 * 2 * kv_element_bytes("CPU") * KV_U8_GROWTH)
    assert f16.runtime < default.runtime  # no scratch to dequantise a u8 cache
    assert start_need(2 * GB, MANIFEST, "CPU", True, 4096, 2, kv_precision="f16").kv == 2 * f16.kv  # exact: f32


def test_start_need_adds_the_second_copy_of_moe_experts_on_cpu():
    moe = {**MANIFEST, "expert_bytes": 3 * GB}  # routed experts of this shard at its precision
    dense_cpu, moe_cpu = start_need(4 * GB, MANIFEST, "CPU", False, 4096, 1), start_need(4 * GB, moe, "CPU", False, 4096, 1)
    assert moe_cpu.runtime - dense_cpu.runtime == 3 * GB and moe_cpu.weights == dense_cpu.weights
    assert start_need(4 * GB, moe, "GPU.0", False, 4096, 1) == start_need(4 * GB, MANIFEST, "GPU.0", False, 4096, 1)


def test_refusals_carry_a_code_and_numbers():
    policy = SharingPolicy(max_ram_gb=8)
    need = start_need(2 * GB, MANIFEST, "CPU", True, 32768, 4)  # 17 GB of f32 KV
    d = check_start(policy, state(), "CPU", 2 * GB, 0, need)
    assert not d.share and d.code == "policy_cap" and d.need_bytes == need.total and d.limit_bytes == 8 * GB
    assert "RAM limit of 8 GB" in d.reason and f"{need.total / GB:.1f} GB" in d.reason
    # Within the cap but not within free RAM less the OS reserve.
    roomy = SharingPolicy(max_ram_gb=64)
    mid = StartNeed(5 * GB, GB, GB // 2)
    d = check_start(roomy, state(avail=7 * GB), "CPU", 5 * GB, 0, mid)
    assert not d.share and d.code == "ram" and d.limit_bytes == 7 * GB - os_reserve(16 * GB)
    assert check_start(roomy, state(avail=9 * GB), "CPU", 5 * GB, 0, mid).share
    # Running workers count against the cap.
    d = check_start(policy, state(), "CPU", 5 * GB, 4 * GB, mid)
    assert d.code == "policy_cap" and d.limit_bytes == 4 * GB
    assert check_start(SharingPolicy(enabled=False), state(), "CPU", GB, 0).code == "not_sharing"
    assert check_start(SharingPolicy(devices=("CPU",)), state(), "NPU", GB, 0).code == "device"
    # Each refusal has its wire form: the reason and, for memory, the bytes.
    from engine.protocol.errors import Refusal

    assert d.refusal() == Refusal("policy_cap", mid.total, 4 * GB)
    off = check_start(SharingPolicy(enabled=False), state(), "CPU", GB, 0)
    assert off.refusal() == Refusal("not_sharing") and off.message() == "not sharing now: sharing is switched off"
    busy = check_start(SharingPolicy(max_cpu_percent_to_start=1.0), state(), "CPU", GB, 0)
    assert busy.refusal() == Refusal("cpu_busy") and busy.message() == busy.reason


def test_the_agent_sizes_a_load_by_the_plans_context_and_streams(tmp_path):
    """LoadRequest carries the plan's context x streams: a worker whose KV would
    break the owner's cap is refused before it starts, one that fits starts."""
    import json
    from types import SimpleNamespace

    import pytest

    from engine.fleet.agent import Agent
    from engine.protocol.control import LoadRequest
    from engine.protocol.errors import ProtocolError, Refusal

    (tmp_path / "shard.json").write_text(json.dumps(MANIFEST))
    agent = SimpleNamespace(policy=SharingPolicy(max_ram_gb=8), state=state(avail=15 * GB),
                            supervisor=SimpleNamespace(running=lambda: []))
    meta = {"size": 4 * GB}
    fits = LoadRequest("r1", "a" * 64, "CPU", 0, True, (), 4096, 1)
    Agent._check_memory(agent, fits, meta, tmp_path)  # 4 GB + 0.27 GB f32 KV + reserve
    big = LoadRequest("r2", "b" * 64, "CPU", 0, True, (), 32768, 4)  # 17 GB of f32 KV
    with pytest.raises(ProtocolError) as e:
        Agent._check_memory(agent, big, meta, tmp_path)
    need = start_need(4 * GB, MANIFEST, "CPU", True, 32768, 4).total
    assert e.value.code == "refused" and e.value.refusal == Refusal("policy_cap", need, 8 * GB)
    assert "RAM limit of 8 GB" in str(e.value) and "[" not in str(e.value)  # the line is for people only
