"""`flotilla bench demos`: the trained demos against their random builds, as the docs quote
them. What must hold whatever the CPU: the JSON is complete, training made held-out text
more predictable, the ReLU demo's FFN has natural zeros, and the samples are what a user
would see. No speed figures here."""

from __future__ import annotations

import argparse

import pytest

from engine.bench import demos
from engine.cli.bench_cmd import scenarios
from engine.models.train_demos import TRAIN_ORDER


def test_demos_scenario_is_discovered():
    assert scenarios()["demos"] is demos


def test_demos_bench_compares_every_trained_demo_with_its_random_build():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    demos.add_arguments(p)
    out = demos.run(p.parse_args(["--quick", "--eval-chunks", "3"]), lambda _line: None)
    assert out["corpus"]["heldout_pieces"] == 3 and out["corpus"]["heldout_bytes"] > 1000
    assert set(out["heldout"]) == set(TRAIN_ORDER)
    for demo_id, row in out["heldout"].items():
        t, r = row["trained"], row["random"]
        assert t["bytes"] == r["bytes"]  # the same held-out text for both builds
        assert t["bits_per_byte"] < r["bits_per_byte"], demo_id
        assert row["bits_per_byte_ratio"] == pytest.approx(t["bits_per_byte"] / r["bits_per_byte"], abs=1e-3)
        assert row["recipe"]["steps"] > 0 and row["recipe"]["corpus"]
    moe = out["heldout"]["demo-moe"]["trained"]["routing_mean"]
    assert 0 < moe["entropy"] <= 1 and 1 / 8 <= moe["top_share"] <= 1
    relu = out["locality"]["demo-relu"]
    assert relu["trained"]["threshold"].startswith("natural zeros")
    assert relu["trained"]["sparsity_mean"] > 0.3  # ReLU: negative gates are exact zeros
    for row in out["locality"].values():
        for label in ("trained", "random"):
            assert 0 <= row[label]["jaccard_mean"] <= 1 and len(row[label]["per_layer"]) == 8
    assert 0 < out["draft"]["top1_agreement"] < 1 and out["draft"]["positions"] > 100
    s = out["samples"]
    assert s["fibonacci"]["text"].startswith("def fibonacci(n):")
    assert [c["prompt"] for c in s["chat"]] == list(demos.CHAT_PROMPTS)
    assert s["chat_ended_share"] == pytest.approx(sum(c["ended"] for c in s["chat"]) / len(s["chat"]))
