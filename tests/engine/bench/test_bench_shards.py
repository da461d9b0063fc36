"""`flotilla bench shards` on a tiny model: the JSON is complete and sane (no speed assertions)."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("openvino")
pytest.importorskip("torch")

from engine.bench import shards  # noqa: E402
from engine.cli.bench_cmd import scenarios  # noqa: E402

TINY = ["--hidden", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--context", "16",
        "--tokens", "3", "--warmup", "1", "--repeats", "2", "--memory-weights", ""]


def _args(extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    shards.add_arguments(p)
    return p.parse_args(["--quick", *extra])


def test_shards_scenario_is_discovered():
    assert scenarios()["shards"] is shards


def test_shards_bench_reports_sane_figures():
    lines: list[str] = []
    out = shards.run(_args(TINY), lines.append)
    json.dumps(out)  # serialisable as the CLI writes it
    assert out["model"]["layers"] == 4 and out["model"]["hidden"] == 64 and out["model"]["params_m"] > 0
    assert out["ranges"] == [[0, 2], [2, 4]]
    for key in ("whole_ms", "split_ms", "split_without_fix_ms", "split_over_whole",
                "split_over_whole_without_fix"):
        assert isinstance(out[key], float) and out[key] > 0, key
    assert out["split_over_whole"] == pytest.approx(out["split_ms"] / out["whole_ms"], rel=1e-2)
    assert out["split_over_whole_without_fix"] == pytest.approx(out["split_without_fix_ms"] / out["whole_ms"],
                                                                rel=1e-2)
    for key in ("split_over_whole_per_repeat", "split_over_whole_without_fix_per_repeat"):
        assert len(out[key]) == 2 and all(isinstance(r, float) and r > 0 for r in out[key]), key
        # Two repeats: the medians are means, and (a1 + a2) / (b1 + b2) lies between a1 / b1 and a2 / b2.
        assert min(out[key]) - 1e-3 <= out[key.removesuffix("_per_repeat")] <= max(out[key]) + 1e-3, key
    # The run's settings are echoed as given.
    assert (out["stages"], out["context_tokens"], out["timed_tokens_per_repeat"], out["warmup_tokens"],
            out["repeats"]) == (2, 16, 3, 1, 2)
    assert out["threads"] == "default" and out["exact_f32"] is False
    assert "whole_without_fix_ms" not in out  # quick: the unfused whole model is not run
    assert out["goals"] == {"split_over_whole": 1.05}
    assert all(len(out["loadavg"][k]) == 3 for k in ("before", "after"))
    m = out["model"]
    assert m["params_m"] == pytest.approx(m["f32_weights_mb"] / 4, abs=0.1)  # f32: 4 bytes a parameter
    assert (m["heads"], m["kv_heads"], m["intermediate"]) == (4, 2, 192)  # 2.75 x 64, rounded to 64
    # Fusion is structural, not a speed: it must hold on any machine.
    assert out["fused_sdpa_all_shards"] is True
    assert out["fused_sdpa_nodes"] == {"whole": [4], "split": [2, 2], "split_nofix": [0, 0]}
    ops = out["runtime_ops_first_shard"]
    assert ops["fused"]["ScaledDotProductAttention"] == 2 and ops["without_fix"]["ScaledDotProductAttention"] == 0
    assert any("repeat 2/2" in line for line in lines)


def test_memory_schedule_fills_the_context_with_varied_chunks_then_one_full_chunk():
    from engine.bench._shard_memory import SMALL_CHUNK_MAX, schedule

    calls = schedule(2048, 512, 16)
    assert sum(calls) == 2048 and calls[-16:] == [1] * 16 and calls[-17] == 512
    small = calls[:-17]
    assert all(1 <= n <= SMALL_CHUNK_MAX for n in small) and len(set(small)) > len(small) // 2
    assert schedule(2048, 512, 16) == calls  # deterministic
    assert schedule(100, 512, 4) == [96, 1, 1, 1, 1]  # a context shorter than the chunk


def test_moe_shards_memory_is_measured_beside_the_plan():
    # A tiny Qwen3-MoE: latency as for Llama, then each shard's memory alone in its own process.
    lines: list[str] = []
    tiny = [a for a in TINY[:-2]] + ["--arch", "qwen3_moe", "--experts", "8", "--top-k", "2",
                                      "--expert-inter", "32", "--memory-weights", "fp16",
                                      "--memory-context", "256", "--memory-decode", "4"]
    out = shards.run(_args(tiny), lines.append)
    json.dumps(out)
    m = out["model"]
    assert (m["architecture"], m["experts"], m["experts_per_token"], m["intermediate"]) == ("qwen3_moe", 8, 2, 32)
    assert out["fused_sdpa_nodes"]["whole"] == [4]
    mem = out["memory"]
    assert mem["context_tokens"] == 256 and sum(mem["call_tokens"]) == 256 and mem["calls"] == len(mem["call_tokens"])
    runs = mem["by_precision"]["fp16"]
    assert [r["layers"] for r in runs["whole"]] == [[0, 4]] and [r["layers"] for r in runs["split"]] == [[0, 2], [2, 4]]
    one_layer_experts = 8 * 3 * 64 * 32 * 2  # 8 experts x (gate, up, down) of 64 x 32 at fp16
    for r in runs["whole"] + runs["split"]:
        n = r["layers"][1] - r["layers"][0]
        assert r["precision"] == "fp16" and r["planned"]["expert_bytes"] == n * one_layer_experts
        assert r["manifest_expert_bytes"] == r["planned"]["expert_bytes"]  # what the agent's start check reads
        # The plan counts the experts' second copy on CPU in the runtime reserve.
        assert r["planned"]["runtime_reserve_bytes"] >= r["planned"]["expert_bytes"]
        meas = r["measured"]
        assert len(meas["anon_after_call_bytes"]) == mem["calls"]
        assert meas["anon_peak_bytes"] == max([meas["anon_after_load_bytes"], *meas["anon_after_call_bytes"]])
        assert meas["anon_after_load_bytes"] > meas["anon_before_load_bytes"] > 0
        assert r["plan_vs_anon"] == pytest.approx(r["planned"]["process_bytes"] / meas["anon_peak_bytes"] - 1, abs=1e-3)
        assert r["shard_bytes"] > n * one_layer_experts  # the experts are in the shard at fp16
    assert any("memory fp16 split [2, 4)" in line for line in lines)
