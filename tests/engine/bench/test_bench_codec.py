"""`flotilla bench codec` at a tiny size, through the CLI as a user runs it: every message
and figure is there, with the provenance block. No speed assertions: the real figures come
from running the benchmark on a quiet machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.bench import codec
from engine.cli.bench_cmd import scenarios

REPO = Path(__file__).resolve().parents[3]


def _check_spread(s: dict) -> None:
    assert set(s) == {"median", "min", "max"}
    assert 0 < s["min"] <= s["median"] <= s["max"]


def test_codec_bench_reports_every_message(tmp_path):
    assert scenarios()["codec"] is codec
    out = tmp_path / "codec.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "engine.cli.main", "bench", "codec", "--quick", "--repeats", "2",
                          "--iterations", "5", "--json", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["scenario"] == "codec" and d["quick"] is True
    assert {"commit", "dirty", "cpu", "load_before", "load_after"} <= set(d["provenance"])
    assert d["settings"] == {"repeats": 2, "iterations": 5}
    assert isinstance(d["codec"]["protocol_version"], int)
    assert set(d["messages"]) == set(codec.messages())
    for row in d["messages"].values():
        assert isinstance(row["kind"], str) and row["bytes"] > 0
        for key in ("roundtrip_us", "encode_us", "decode_us", "construct_us"):
            _check_spread(row[key])
    assert d["messages"]["chunk_request_64k"]["bytes"] > 65_536
    assert set(d["frames"]) == set(codec.framed())
    for row in d["frames"].values():
        assert row["frames"] == 2 and row["header_bytes"] > 0 and row["tensor_bytes"] > 0
        for key in ("roundtrip_us", "encode_us", "decode_us"):
            _check_spread(row[key])
    assert d["per_token_messages"] == ["pipeline_step", "pipeline_result"]
    assert d["per_token_us"] == round(sum(d["messages"][n]["roundtrip_us"]["median"]
                                          for n in d["per_token_messages"]), 3)
