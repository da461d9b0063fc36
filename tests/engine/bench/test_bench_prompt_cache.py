"""`flotilla bench prompt-cache` at a tiny size, on every engine it runs: every figure is there
and consistent.
No speed assertions: the real figures come from running the benchmark. Exact f32 math and
KV, so "the cached answer is the uncached one" does not hang on a CPU's bf16 rounding."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.bench import prompt_cache


@pytest.mark.parametrize("engine,model", [("local", "random-llama-tiny"), ("pipeline", "random-llama-tiny"),
                                          ("moe", "demo-moe"), ("sparse", "demo")])
def test_prompt_cache_bench_reports_consistent_figures(engine, model):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    prompt_cache.add_arguments(p)
    args = p.parse_args(["--quick", "--model", model, "--history", "300", "--answer", "6",
                         "--rounds", "2", "--engine", engine, "--precision", "f32"])
    out = prompt_cache.run(args, lambda _line: None)
    json.dumps(out, allow_nan=False)
    assert len(out["rounds"]) == 2 and out["history"] == 300 and out["engine"] == engine
    assert out["precision"] == "f32" and out["kv_cache_precision"] == "f32"
    for row in out["rounds"]:
        assert row["identical"] is True  # the cached answer is the uncached one
        assert row["first_difference"] is None and row["same_tokens"] == 1.0
        assert row["uncached_cached_tokens"] == 0  # with the pool emptied nothing is reused
        # the history at least, in whole KV blocks on the paged local engine
        grain = out["memory"].get("grain_tokens", 1)
        assert row["history_tokens"] - grain < row["turn2_cached_tokens"] < row["turn2_prompt_tokens"]
        assert row["turn2_over_turn1"] == round(row["turn2_ttft_s"] / row["turn1_ttft_s"], 4)
    assert out["goal"]["identical"] is True and out["passed"] == all(out["goal"].values())
    if engine in ("moe", "sparse"):  # they read weights from a store while they run: its read mode is recorded
        assert out["io"]["requested"] in ("o_direct", "buffered") and out["io"]["effective"]


def test_first_difference_names_where_two_answers_part():
    assert prompt_cache.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert prompt_cache.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert prompt_cache.first_difference([1, 2], [1, 2, 3]) == 2  # one ended early
