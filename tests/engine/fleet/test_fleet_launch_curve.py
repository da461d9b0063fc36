"""`curve_overhead` of `flotilla bench pipeline` (engine/bench/_curve.py) on a tiny model:
both rings run, the figures are sane, nothing is left behind. No speed
assertion here: the real figure comes from running the benchmark."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

pytest.importorskip("openvino")
pytest.importorskip("torch")

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or shutil.which("taskset") is None,
                                     reason="needs 2 cores and taskset")


def _children() -> list[str]:
    """This process's children but `ps` and the suite's background bundle build (tests/conftest.py)."""
    me = str(os.getpid())
    res = subprocess.run(["ps", "-eo", "ppid=,args="], capture_output=True, text=True)
    return [ln for ln in res.stdout.splitlines()
            if ln.split(None, 1)[0] == me and "ps -eo" not in ln and "installers.build" not in ln]


@needs_two_cores
def test_curve_overhead_figures(tmp_path):
    from engine.bench._curve import hop_cost_us, measure_curve_overhead
    from engine.bench.shards import dense_recipe
    from engine.pipeline.runner import even_split
    from engine.models.demo import ensure_recipe
    from engine.shards.export import ensure_shard

    recipe = dense_recipe(64, 4, None, 4, 2)
    path = ensure_recipe(recipe)
    ranges = list(even_split(4, 2))
    shards = [ensure_shard(path, s, e, num_layers_total=4).path for s, e in ranges]
    cores = sorted(os.sched_getaffinity(0))[:2]
    out = measure_curve_overhead(path, recipe.demo_id, shards, ranges, cores, streams=(1, 2), tokens=3,
                                 repeats=1, min_pairs=2, hidden=64, log_dir=tmp_path)
    json.dumps(out)
    assert isinstance(out["curve_overhead"], float) and -1.0 < out["curve_overhead"] < 1.0
    assert out["curve_overhead_goal"] == 0.03
    assert set(out["curve_aggregate_tok_s"]) == {"plaintext", "curve"}
    assert all(v > 0 for ring in out["curve_aggregate_tok_s"].values() for v in ring.values())
    assert len(out["curve_overhead_paired_per_repeat"]["2"]) == 2  # min_pairs for the headline case
    assert len(out["curve_overhead_paired_per_repeat"]["1"]) == 1  # repeats for the others
    hop = out["curve_hop_us"]
    assert hop["plaintext"] > 0 and hop["curve"] > 0 and hop["frame_bytes"] > 64 * 4
    # The added time is a difference of two medians: noise may make it negative on a busy
    # machine, so check the model's arithmetic, not its sign.
    assert hop["added_per_round_trip"] == pytest.approx(hop["curve"] - hop["plaintext"], abs=0.11)
    per_token_us = 1e6 / out["curve_aggregate_tok_s"]["plaintext"]["1"]
    want = (len(shards) + 1) * hop["added_per_round_trip"] / 2 / per_token_us
    assert out["curve_overhead_model"] == pytest.approx(want, abs=1e-5) and abs(want) < 1.0
    assert not _children(), "stage processes outlived the measurement"
    assert set(hop_cost_us(16, rounds=50)) == {"plaintext", "curve", "added_per_round_trip", "frame_bytes"}
