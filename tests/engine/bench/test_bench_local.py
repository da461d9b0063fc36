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
    args = p.parse_args(["--quick", "--models", "demo-draft", "--tokens", "6", "--repeats", "2"])
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
