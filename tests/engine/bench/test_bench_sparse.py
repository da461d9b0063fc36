"""`flotilla bench sparse` on a tiny model: the JSON is complete and consistent, the I/O
mode it reports is the one in effect, and no speedup is reported when O_DIRECT was
asked for but reads went through the page cache. No speed assertions, nothing that
depends on what a random-weight model says (its tokens).

Also the neuron store's own account of its I/O mode (io_mode / io_fallback_reason):
O_DIRECT on the repository's disk, buffered with a reason (and a warning) on tmpfs
and when the file system refuses O_DIRECT -- it used to fall back silently.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.bench import _sparse_model, _sparse_runs, sparse  # noqa: E402
from engine.cli.bench_cmd import scenarios  # noqa: E402
from engine.platform import direct_io as io_mod  # noqa: E402  (the O_DIRECT probe both stores use)
from engine.platform.direct_io import IO_MODES, fs_type  # noqa: E402

REPO_SCRATCH = Path(__file__).resolve().parents[3] / ".cache"  # the repository's disk, whatever FLOTILLA_CACHE is
SHAPE = dict(layers=2, hidden=1024, intermediate=2048, heads=8, kv_heads=2)  # bf16: 4 KiB exact-mode bundles
TINY = ["--shape", "synthetic", "--layers", "2", "--hidden", "1024", "--intermediate", "2048", "--heads", "8", "--kv-heads", "2",
        "--tokens", "3", "--repeats", "1", "--sparsities", "0,0.8"]


def _args(extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    sparse.add_arguments(p)
    return p.parse_args(["--quick", *extra])


def _speedup_keys(d: dict, path: tuple = ()) -> list[tuple]:
    keys = []
    for k, v in d.items():
        if k.startswith("goal") or k == "speedup_refused":
            continue
        if "speedup" in k:
            keys.append(path + (k,))
        elif isinstance(v, dict):
            keys += _speedup_keys(v, path + (k,))
    return keys


def _get(d: dict, path: tuple):
    for part in path:
        d = d[part]
    return d


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from engine.models.demo import ensure_recipe

    return _sparse_model.with_dtype(ensure_recipe(_sparse_model.bench_recipe(True, **SHAPE)), "bf16", lambda _m: None)


@pytest.fixture(scope="module")
def store_on_disk(tiny_model):
    """An exact-mode bundle store in a temp folder on the repository's disk."""
    from engine.sparse.store import build_store
    from engine.sparse.weights import MappedWeights, ffn_layout

    REPO_SCRATCH.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="test-sparse-io-", dir=REPO_SCRATCH))
    try:
        yield build_store(MappedWeights(tiny_model), ffn_layout(tiny_model), tmp / "store", "exact")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_sparse_scenario_is_discovered():
    assert scenarios()["sparse"] is sparse


def test_default_bench_model_keeps_its_published_shape():
    r = _sparse_model.bench_recipe(True)
    assert r.demo_id == "sparse-bench-h4096-2l"
    assert (r.config["hidden_size"], r.config["intermediate_size"], r.config["num_hidden_layers"]) == (4096, 14336, 2)
    assert _sparse_model.bench_recipe(False).config["num_hidden_layers"] == 4


# -- the store: which I/O mode is really in effect ------------------------------------------
def test_bundle_store_reads_o_direct_on_the_repo_disk_and_buffered_on_tmpfs(store_on_disk, caplog):
    from engine.sparse.store import BundleStore

    assert fs_type(store_on_disk) == "other", f"{store_on_disk} should be on the repository's disk, not in RAM"
    ids = np.array([0, 1, 7, 2047])
    s = BundleStore(store_on_disk)
    try:
        assert s.io_mode == "o_direct" and s.io_fallback_reason is None
        assert s.io_info() == {"requested": "o_direct", "effective": "o_direct", "fallback_reason": None}
        want = s.read(1, ids).copy()
    finally:
        s.close()

    # Linux mounts /dev/shm as tmpfs; the fallback below is what this test is about.
    assert fs_type("/dev/shm") == "tmpfs", "this test needs /dev/shm to be a tmpfs"
    shm = Path(tempfile.mkdtemp(prefix="flotilla-test-sparse-", dir="/dev/shm"))
    try:
        shutil.copytree(store_on_disk, shm / "store")
        with caplog.at_level(logging.WARNING, logger="engine.sparse.store"):
            r = BundleStore(shm / "store")
        try:
            assert r.io_mode == "buffered" and "tmpfs" in r.io_fallback_reason
            assert r.io_info() == {"requested": "o_direct", "effective": "buffered",
                                   "fallback_reason": r.io_fallback_reason}
            warned = [x.getMessage() for x in caplog.records if "O_DIRECT is not in effect" in x.getMessage()]
            assert len(warned) == 1 and "tmpfs" in warned[0]  # once per store, not once per layer file
            np.testing.assert_array_equal(r.read(1, ids), want)  # buffered reads: same verified bundles
        finally:
            r.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_bundle_store_falls_back_with_a_warning_when_o_direct_is_refused(store_on_disk, monkeypatch, caplog):
    from engine.sparse.store import BundleStore, StoreConfig

    real_open = os.open

    def refusing_open(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(io_mod.os, "open", refusing_open)
    with caplog.at_level(logging.WARNING, logger="engine.sparse.store"):
        s = BundleStore(store_on_disk)
    try:
        assert s.io_mode == "buffered" and "refuses O_DIRECT" in s.io_fallback_reason
        assert any("O_DIRECT is not in effect" in x.getMessage() for x in caplog.records)
        assert s.read(0, np.array([3, 4])).shape[0] == 2
    finally:
        s.close()
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.sparse.store"):
        b = BundleStore(store_on_disk, StoreConfig(direct=False))  # buffered on purpose: no fallback, no warning
    try:
        assert b.io_info() == {"requested": "buffered", "effective": "buffered", "fallback_reason": None}
        assert not caplog.records
    finally:
        b.close()


# -- the benchmark -----------------------------------------------------------------------
def test_sparse_bench_reports_consistent_figures(tiny_model):
    from engine.sparse.baseline import cgroups_available

    lines: list[str] = []
    out = sparse.run(_args(TINY), lines.append)
    json.dumps(out)  # serialisable as the CLI writes it
    m = out["model"]
    assert (m["layers"], m["hidden"], m["neurons"], m["dtype"]) == (2, 1024, 2048, "bf16")
    assert m["ffn_bytes"] == 2 * 3 * 1024 * 2048 * 2 and m["non_ffn_resident_bytes"] > 0
    assert out["cap_bytes"] == m["ffn_bytes"] // 2
    assert out["cache_budget_bytes"] == out["cap_bytes"] - out["fixed_ffn_side_bytes"] > 0
    assert out["bundle_bytes_on_disk"] % 4096 == 0 and 0 < out["bundle_bytes_in_ram"] <= out["bundle_bytes_on_disk"]
    assert (out["mode"], out["sparsity"], out["decode_tokens"], out["repeats"]) == ("exact", 0.8, 3, 1)

    io = out["io"]
    assert set(io) == {"requested", "effective", "fallback_reason"}
    assert io["requested"] == "o_direct" and io["effective"] in IO_MODES
    assert (io["fallback_reason"] is None) == (io["effective"] == "o_direct")

    t, b = out["tok_s"], out["bytes_read_per_token"]
    for k in ("ours", "on_demand", "all_resident_sparse", "all_resident_dense"):
        assert isinstance(t[k], float) and t[k] > 0, k
    assert b["ours"] > 0 and b["on_demand"] > 0  # the cache starts cold every run: active neurons are read
    assert out["reads_per_token_ours"] > 0
    has_mmap = cgroups_available()
    if has_mmap:  # we are root with cgroup v1 here; the tiny FFN may fit the slack, so 0 bytes is legitimate
        assert t["mmap"] > 0 and b["mmap"] >= 0 and out["mmap_read_mb_s"] >= 0
        cg = out["mmap_cgroup"]
        assert cg["cgroup_limit_bytes"] >= cg["setup_usage_bytes"] + out["cap_bytes"]
    else:
        assert t["mmap"] is None and isinstance(out["mmap_cgroup"], str)

    for k in ("ours", "on_demand"):
        assert 0 <= out["cache_hit_rate"][k] <= 1, k
        assert 0 <= out["io_share_of_latency"][k] <= 1, k
    assert 0 <= out["on_demand_share_ours"] <= 1
    assert out["prefetch_precision_runtime"] is None or 0 <= out["prefetch_precision_runtime"] <= 1
    assert 0 < out["active_neurons_per_token"] <= m["layers"] * m["neurons"]
    tm = out["time_per_token_ms_ours"]
    assert tm["total"] == pytest.approx(1e3 / t["ours"], rel=1e-3)  # one repeat: the same run
    assert tm["io_wait"] >= 0 and tm["crc_verify"] >= 0
    assert tm["io_wait"] + tm["crc_verify"] + tm["other_compute_and_python"] == pytest.approx(tm["total"], abs=0.02)
    ov = out["overlap_jaccard"]
    assert 0 <= ov["calibration_text_mean"] <= 1 and all(0 <= j <= 1 for j in ov["per_layer"])
    assert 0 <= ov["decode_runtime_mean"] <= 1
    d = 1 - ov["sparsity_measured"]  # two independent sets of the measured density overlap d / (2 - d)
    assert abs(ov["sparsity_measured"] - 0.8) < 0.05
    assert ov["independent_sets_same_density"] == pytest.approx(d / (2 - d), abs=1e-4)
    for k, v in out["predictor"].items():
        assert v is None or 0 <= v <= 1, k
    assert out["disk"]["bundle_bytes"] == out["bundle_bytes_on_disk"] and out["disk"]["random"]
    assert isinstance(out["same_tokens_ours_vs_on_demand"], bool)
    runs = out["scenario_replayed_trace"]["runs"]
    assert set(runs) == {"0.5", "0.85"} and "SCENARIO" in out["scenario_replayed_trace"]["label"]
    for j, r in runs.items():
        assert 0 <= r["jaccard_measured"] <= 1 and r["tok_s"] > 0 and r["bytes_read_per_token"] >= 0, j

    # speed and quality side by side at every threshold; the headline at equal quality
    rows = out["thresholds"]
    assert [r["sparsity"] for r in rows] == [0.0, 0.8]
    assert rows[0]["top1_agreement"] == 1.0 and rows[0]["ppl_change_pct"] == 0.0  # threshold 0 is the dense model
    for r in rows:
        assert 0 <= r["top1_agreement"] <= 1 and r["ppl_sparse"] > 0, r
        if r["skipped"]:  # at threshold 0 one layer's active set is all of it: more than this tiny cap leaves
            assert r["tok_s"] is None and "does not fit" in r["skipped"], r
            continue
        assert r["tok_s"] > 0 and r["cache_budget_bytes"] > 0 and r["bytes_per_token"] > 0, r
        if has_mmap:  # ours ran in a capped child with the mmap baseline's allowance above its setup
            assert r["max_usage_bytes"], r
    assert rows[1]["skipped"] is None  # the bench's own --sparsity always runs
    assert out["top1_agreement_at_sparsity"] == rows[1]["top1_agreement"]
    assert out["ours_capped"] is has_mmap
    eq = out["equal_quality"]
    assert eq["min_top1_agreement"] == 0.9
    good = [r["sparsity"] for r in rows if r["top1_agreement"] >= 0.9 and r["tok_s"]]
    assert eq["sparsity"] == (max(good) if good else None)
    if good:
        assert eq["top1_agreement"] >= 0.9
    else:
        assert "agreement" in eq["reason"] and eq["speedup_vs_mmap"] is None

    assert out["goal_speedup_vs_mmap"] == 8.0
    speedups = _speedup_keys(out)
    assert {("speedup_vs_mmap",), ("speedup_vs_on_demand",), ("equal_quality", "speedup_vs_mmap")} <= set(speedups)
    if io["effective"] != "o_direct":  # e.g. FLOTILLA_CACHE on a tmpfs
        assert "page cache" in out["speedup_refused"] and out["goal_met"] is None
        assert all(_get(out, k) is None for k in speedups)
        return
    assert "speedup_refused" not in out
    # Speedups are the ratios of the reported tok/s (rounded to 2 decimals).
    assert out["speedup_vs_on_demand"] == pytest.approx(t["ours"] / t["on_demand"], abs=0.006)
    if has_mmap:
        assert out["speedup_vs_mmap"] == pytest.approx(t["ours"] / t["mmap"], abs=0.006)
        for r in rows:
            if r["tok_s"]:
                assert r["speedup_vs_mmap"] == pytest.approx(r["tok_s"] / t["mmap"], abs=0.006), r
        if good:
            assert eq["speedup_vs_mmap"] == pytest.approx(eq["tok_s"] / t["mmap"], abs=0.006)
        assert out["goal_met"] is (out["speedup_vs_mmap"] >= 8.0)
        for j, r in runs.items():
            assert r["speedup_vs_mmap"] == pytest.approx(r["tok_s"] / t["mmap"], abs=0.006), j
        bound = out["bound"]
        assert bound["mmap_ms_per_token"] == pytest.approx(1e3 / t["mmap"], abs=0.06)
        assert bound["ours_ms_per_token"] == pytest.approx(1e3 / t["ours"], abs=0.06)
        assert bound["disk_mb_s_used"] == pytest.approx(max(bound["disk_mb_s_probe"], bound["disk_mb_s_achieved"]),
                                                        abs=0.06)
        # the I/O bound is ours' bytes at that rate, and no slower than the time ours really waited for them
        # (reported to 0.1 ms: at a fast disk the bound is a few ms, so the rounding alone is over 1 %)
        assert bound["ours_io_lower_bound_ms"] == pytest.approx(b["ours"] / bound["disk_mb_s_used"] / 1e3,
                                                                rel=0.01, abs=0.06)
        assert bound["ours_io_lower_bound_ms"] <= tm["io_wait"] * 1.01 + 0.1
        worst = max(bound["ours_io_lower_bound_ms"], bound["ours_compute_floor_ms"])
        assert bound["max_speedup_if_io_fully_hidden"] == pytest.approx(bound["mmap_ms_per_token"] / worst, rel=0.05)
    else:
        assert out["speedup_vs_mmap"] is None and out["goal_met"] is False
    assert any("repeat 1/1: ours" in line for line in lines)


def test_real_shape_runs_every_engine_under_one_absolute_cap_and_refuses_speedups_without_o_direct(
        monkeypatch, caplog):
    """`--shape llama-3.1-8b` on a few-MB stand-in of the same recipe (the checkpoint builder's
    sharded bf16 files): ours, on-demand and the mmap baseline each run in a memory group capped
    at cap-fraction x the checkpoint from its first byte, ours picking its own cache budget under
    it. And, as if the store lived on tmpfs (O_DIRECT requested, reads buffered), every speedup
    is refused."""
    from engine.bench._checkpoint import LLAMA_3_1_8B, checkpoint_bytes, checkpoint_path
    from engine.models.demo import TOKENIZER_VOCAB

    spec = LLAMA_3_1_8B.scaled(name="test-sparse-real-shape", hidden_size=256, intermediate_size=1024,
                               num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=TOKENIZER_VOCAB,
                               max_position_embeddings=4096, rope_scaling=None, max_file_bytes=4 << 20)
    monkeypatch.setattr(_sparse_model, "real_spec", lambda layers, quick: spec)
    monkeypatch.setattr(io_mod, "fs_type", lambda _path: "tmpfs")
    frac = 150.0  # the interpreter and torch alone are ~300 MB: far more than this 6 MB model
    lines: list[str] = []
    with caplog.at_level(logging.WARNING, logger="engine.sparse.store"):
        out = sparse.run(_args(["--shape", "llama-3.1-8b", "--cap-fraction", str(frac), "--tokens", "3",
                                "--repeats", "1", "--sparsities", "0,0.8"]), lines.append)
    json.dumps(out)
    ckpt = checkpoint_bytes(checkpoint_path(spec))
    assert len(list(checkpoint_path(spec).glob("model-*.safetensors"))) >= 2  # sharded, as shipped
    assert out["model"]["shape"] == "llama-3.1-8b" and out["model"]["checkpoint_bytes"] == ckpt
    assert out["mode"] == "predicted" and out["cap_rule"].startswith("absolute")
    assert out["cap_bytes"] == int(ckpt * frac) and out["checkpoint_over_cap"] == round(1 / frac, 2)
    for who in ("ours_cgroup", "mmap_cgroup"):  # the same limit, set before the child's first byte
        cg = out[who]
        assert cg["cgroup_limit_bytes"] == out["cap_bytes"], who
        assert cg["max_usage_bytes"] <= out["cap_bytes"], who
    assert out["ours_cgroup"]["oom_kills"] == 0
    for r in out["thresholds"]:  # the engine chose its budget: at least one layer's set, at most the cap
        assert r["skipped"] is None and out["min_cache_budget_bytes"] <= r["cache_budget_bytes"] < out["cap_bytes"]
    assert out["thresholds"][0]["top1_agreement"] == 1.0  # threshold 0 in predicted mode: the dense model
    assert out["context_length"] == _sparse_runs.CONTEXT
    assert out["io"]["requested"] == "o_direct" and out["io"]["effective"] == "buffered"
    assert "tmpfs" in out["io"]["fallback_reason"]
    assert "O_DIRECT was requested" in out["speedup_refused"] and "page cache" in out["speedup_refused"]
    speedups = _speedup_keys(out)
    want = {("speedup_vs_mmap",), ("speedup_vs_on_demand",),
            ("scenario_replayed_trace", "runs", "0.5", "speedup_vs_mmap")}
    if "bound" in out:  # with the mmap baseline (cgroups) and a disk probe
        want.add(("bound", "max_speedup_if_io_fully_hidden"))
    assert want <= set(speedups)
    assert all(_get(out, k) is None for k in speedups), {k: _get(out, k) for k in speedups}
    assert all(r["speedup_vs_mmap"] is None for r in out["thresholds"])  # rows of a list too
    assert out["goal_met"] is None and out["goal_speedup_vs_mmap"] == 8.0
    assert out["tok_s"]["ours"] > 0  # the figures themselves stay, labelled by io
    assert any("speedups refused" in line for line in lines)
    assert any("O_DIRECT is not in effect" in x.getMessage() for x in caplog.records)
