"""`flotilla bench local` at its smallest: fields present and consistent, nothing left behind."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("openvino")

from engine.bench import local  # noqa: E402


def test_local_bench_reports_consistent_figures() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    local.add_arguments(p)
    args = p.parse_args(["--quick", "--models", "demo-draft", "--tokens", "6", "--repeats", "2",
                         "--memory-model", "random-llama-tiny"])
    before = set(Path(tempfile.gettempdir()).glob("flotilla-bench-local-*"))
    out = local.run(args, lambda _line: None)
    json.dumps(out)
    assert out["tokens_requested"] == 6 and out["repeats"] == 2
    assert out["build_demos_s"] > 0
    first = out["launch_first_byte_s"]
    assert first["model"] == "demo-draft" and len(first["warm_per_repeat"]) == 2
    assert 0 < first["warm"] and 0 < first["cold"]
    eng = out["engine"]["demo-draft"]
    assert len(eng["per_repeat"]) == 2
    # ignore_eos: every measured answer has exactly the requested length, whatever the weights say
    assert all(r["tokens"] == 6 for r in eng["per_repeat"]) and eng["tokens"] == 6
    assert eng["decode_tok_s"] > 0 and eng["ttft_ms"] > 0
    assert set(Path(tempfile.gettempdir()).glob("flotilla-bench-local-*")) == before  # its cache is removed
    # side by side: our engine and openvino_genai on one IR, a child process each (quick: one per engine)
    side = out["side_by_side"]
    assert side["model"] == "random-llama-tiny" and side["processes"] == 1 and side["tokens"] == 6
    assert side["ir_bytes"] > 0 and side["checkpoint_bytes"] > 0
    for name in ("ours", "genai"):
        e = side[name]
        assert len(e["per_process"]) == 1 and e["tokens"] == 6  # every answer has exactly the length asked
        for key in ("peak_anon_bytes", "vm_hwm_bytes", "rss_after_load_bytes", "ttft_warm_ms", "decode_tok_s"):
            spread = e[key]
            assert 0 < spread["min"] <= spread["median"] <= spread["max"], (name, key, spread)
        # the kernel's peak RSS covers the RSS seen after load; the sampled anon peak the anon after answers
        assert e["vm_hwm_bytes"]["max"] >= e["rss_after_load_bytes"]["max"]
        assert e["peak_anon_bytes"]["max"] >= 0.9 * e["anon_after_answers_bytes"]["max"]
    # speed: both engines in one process, rounds alternating who goes first, ratios taken per round
    inter = side["interleaved"]
    assert inter["rounds"] == 3 and len(inter["per_round"]) == 3
    assert [row["order"][0] for row in inter["per_round"]] == ["ours", "genai", "ours"]
    for row in inter["per_round"]:
        assert row["ours"]["tokens"] == row["genai"]["tokens"] == 6
        assert row["ours"]["cpu_ms_per_token"] > 0 and row["genai"]["cpu_ms_per_token"] > 0
    ratios = sorted(row["ours"]["decode_tok_s"] / row["genai"]["decode_tok_s"] for row in inter["per_round"])
    per_round = inter["ours_over_genai"]["decode_tok_s"]
    assert per_round["min"] == pytest.approx(ratios[0], abs=1e-3)
    assert per_round["median"] == pytest.approx(ratios[1], abs=1e-3)
    assert per_round["max"] == pytest.approx(ratios[2], abs=1e-3)
    ratio = side["ours_vs_genai"]
    assert set(ratio) == {"peak_anon", "vm_hwm", "decode_tok_s", "ttft_warm", "cpu_ms_per_token"}
    assert ratio["decode_tok_s"] == per_round["median"]
    assert ratio["peak_anon"] == pytest.approx(
        side["ours"]["peak_anon_bytes"]["median"] / side["genai"]["peak_anon_bytes"]["median"], abs=1e-3)
    assert side["goal"] == {"decode_at_least_genai": ratio["decode_tok_s"] >= 1.0,
                            "ttft_at_most_genai": ratio["ttft_warm"] <= 1.0,
                            "peak_anon_within_10pct": ratio["peak_anon"] <= 1.1}
