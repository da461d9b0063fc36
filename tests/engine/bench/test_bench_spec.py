"""`flotilla bench spec` at a tiny size: every figure is there and consistent.

No speed assertions and nothing about what the random-weight models say: the
real figures come from running the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

import pytest

pytest.importorskip("openvino")
pytest.importorskip("torch")
pytest.importorskip("zmq")

from engine.bench import spec  # noqa: E402

TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--tokens", "8", "--repeats", "1",
        "--contexts", "16", "--targets", "0.7", "--no-genai"]

# The figures the benchmark reported before the real pair was added: kept.
OLD_KEYS = {"model", "decode_step_ms", "mask_rollback_ms", "trim_rollback_ms", "rollback", "mask_rollback_under_1pct",
            "compact_fraction", "drafts", "throughput", "speedup_at_70pct", "identical_to_greedy", "openvino_genai",
            "decode_step_ms_at_256"}


def _args(extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    spec.add_arguments(p)
    return p.parse_args(["--quick", *extra])


def _my_children() -> list[str]:
    me = str(os.getpid())
    res = subprocess.run(["ps", "-eo", "ppid=,args="], capture_output=True, text=True)
    return [ln for ln in res.stdout.splitlines() if ln.split(None, 1)[0] == me and "ps -eo" not in ln]


@pytest.fixture(scope="module")
def figures() -> dict:
    lines: list[str] = []
    out = spec.run(_args(TINY), lines.append)
    json.dumps(out, allow_nan=False)  # valid JSON: no NaN or infinity
    return out


def _check_run(run: dict, mode: str) -> None:
    """One speculative case against plain greedy: its figures agree with each other."""
    assert run["k"] == 4 and run["adaptive"] is False and run["stages"] == 2
    assert 0.0 <= run["acceptance"] <= 1.0
    assert 0.0 <= run["accepted_of_drafted"] <= 1.0
    assert 0 <= run["accepted"] <= run["drafted"] <= run["k"] * run["verify_steps"]
    if run["drafted"]:
        assert run["accepted_of_drafted"] == pytest.approx(run["accepted"] / run["drafted"], abs=1e-3)
    assert run["verify_steps"] >= 1
    assert 1.0 <= run["tokens_per_step"] <= run["k"] + 1
    assert run["tokens_per_step"] == pytest.approx((run["accepted"] + run["verify_steps"]) / run["verify_steps"],
                                                   abs=1e-3)
    assert set(run["tok_s"]) == {"off", mode}
    assert all(isinstance(v, float) and v > 0 for v in run["tok_s"].values())
    assert run["speedup"] == pytest.approx(run["tok_s"][mode] / run["tok_s"]["off"], abs=2e-3)
    assert 1 <= run["tokens"] <= run["max_tokens"] == 8
    assert isinstance(run["identical_to_greedy"], bool)


def test_spec_bench_keeps_its_figures_and_says_the_pair_is_synthetic(figures):
    assert OLD_KEYS <= set(figures)
    pair = figures["pair"]
    assert pair["synthetic"] is True
    assert isinstance(pair["description"], str) and pair["description"] and "\n" not in pair["description"]
    assert "synthetic" in pair["description"]
    thr = figures["throughput"]
    assert set(thr["speedup"]) == {"draft70", "lookup"}
    for name, s in thr["speedup"].items():
        assert s == pytest.approx(thr["tok_s"][name] / thr["tok_s"]["off"], abs=2e-3)
        assert 0.0 <= thr["measured"][name]["acceptance"] <= 1.0
    assert figures["speedup_at_70pct"] == thr["speedup"]["draft70"]
    assert [d["target_acceptance"] for d in figures["drafts"]] == [0.7]
    assert 0.0 <= figures["drafts"][0]["teacher_forced_acceptance"] <= 1.0
    assert set(figures["rollback"]) == {"16"}
    assert figures["openvino_genai"]["supported"] is False


def test_spec_bench_reports_the_real_pair(figures):
    real = figures["real_pair"]
    assert real["pair"]["synthetic"] is False
    assert (real["pair"]["target"], real["pair"]["draft"]) == ("demo", "demo-draft")
    assert real["pair"]["description"] and "\n" not in real["pair"]["description"]
    assert real["prompt"] == spec.PROMPT
    _check_run(real, "draft")
    assert real["drafted"] > 0  # a draft model always proposes


def test_spec_bench_reports_prompt_lookup_on_the_real_target(figures):
    look = figures["real_lookup"]
    assert look["target"] == "demo" and look["prompt"] == spec.LOOKUP_PROMPT
    _check_run(look, "lookup")


def test_identical_to_greedy_covers_every_run(figures):
    runs = [figures["throughput"]["identical"], figures["real_pair"]["identical_to_greedy"],
            figures["real_lookup"]["identical_to_greedy"]]
    assert figures["identical_to_greedy"] is all(runs)


def test_spec_bench_leaves_no_process_behind(figures):
    assert not [c for c in _my_children() if "engine.shards.worker" in c or "_child_main" in c]


def test_spec_stats_definitions():
    s = spec._spec_stats({"proposed": 20, "accepted": 6, "rejections": 4, "steps": 5})
    assert s == {"acceptance": 0.6, "accepted_of_drafted": 0.3, "drafted": 20, "accepted": 6, "verify_steps": 5,
                 "tokens_per_step": 2.2}
    assert spec._spec_stats({})["acceptance"] == 0.0 and spec._spec_stats({})["tokens_per_step"] == 0.0


def test_no_real_option_is_declared():
    a = _args(["--no-real", "--pair-target", "demo-qwen3", "--pair-draft", "demo"])
    assert a.no_real and a.pair_target == "demo-qwen3" and a.pair_draft == "demo"
