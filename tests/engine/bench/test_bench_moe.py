"""`flotilla bench moe` on a tiny model: the JSON is complete and consistent, the I/O
mode it reports is the one in effect, and no speedup is reported when O_DIRECT was
asked for but reads went through the page cache. No speed assertions.

Also the expert store's own account of its I/O mode (io_mode / io_fallback_reason):
O_DIRECT on the repository's disk, buffered with a reason on tmpfs (whose pages are
RAM; recent kernels accept O_DIRECT there, so the store must tell it apart itself)
and when the file system refuses O_DIRECT.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.bench import moe  # noqa: E402
from engine.cli.bench_cmd import scenarios  # noqa: E402
from engine.platform import direct_io  # noqa: E402
from engine.moe.store import ExpertStore, StoreConfig  # noqa: E402
from engine.platform.pread import aligned_buffer  # noqa: E402
from engine.platform.direct_io import IO_MODES, fs_type  # noqa: E402

LAYERS, EXPERTS = 2, 8
TINY = ["--shape", "synthetic", "--layers", str(LAYERS), "--experts", str(EXPERTS), "--hidden", "64", "--expert-inter", "128",
        "--tokens", "3"]
REPO_SCRATCH = Path(__file__).resolve().parents[3] / ".cache"  # the repository's disk, whatever FLOTILLA_CACHE is
SCHEDS = {"bevy", "on_demand", "prefetch", "resident"}


def _args(extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    moe.add_arguments(p)
    return p.parse_args(["--quick", *extra])


@pytest.fixture(scope="module")
def tiny_store() -> Path:
    """The expert store of the benchmark's tiny model (built once, in the Flotilla cache)."""
    from engine.models.demo import ensure_recipe
    from engine.moe.convert import ensure_store
    from engine.moe.recipes import bench_recipe

    recipe = bench_recipe(LAYERS, EXPERTS, 64, 128)
    return ensure_store(ensure_recipe(recipe), recipe.fingerprint())


def _speedup_keys(d: dict, path: tuple = ()) -> list[tuple]:
    """Every key holding a speedup figure (goals are targets, not figures)."""
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


def test_moe_scenario_is_discovered():
    assert scenarios()["moe"] is moe


# -- the store: which I/O mode is really in effect ------------------------------------------
def test_expert_store_reads_o_direct_on_the_repo_disk_and_buffered_on_tmpfs(tiny_store, caplog):
    REPO_SCRATCH.mkdir(parents=True, exist_ok=True)
    disk = Path(tempfile.mkdtemp(prefix="test-moe-io-", dir=REPO_SCRATCH))
    try:
        shutil.copytree(tiny_store, disk / "store")
        assert fs_type(disk) == "other", f"{disk} should be on the repository's disk, not in RAM"
        on_disk = ExpertStore(disk / "store")
    finally:
        shutil.rmtree(disk, ignore_errors=True)  # the open fd keeps the file readable
    try:
        assert on_disk.io_mode == "o_direct" and on_disk.direct
        assert on_disk.io_fallback_reason is None
        assert on_disk.io_info() == {"requested": "o_direct", "effective": "o_direct", "fallback_reason": None}
        key = on_disk.keys[-1]
        want = aligned_buffer(on_disk.index.blob_bytes)
        on_disk.read_into(key, want)
    finally:
        on_disk.close()

    # Linux mounts /dev/shm as tmpfs; the fallback below is what this test is about.
    assert fs_type("/dev/shm") == "tmpfs", "this test needs /dev/shm to be a tmpfs"
    shm = Path(tempfile.mkdtemp(prefix="flotilla-test-moe-", dir="/dev/shm"))
    try:
        copy = shm / "store"
        shutil.copytree(tiny_store, copy)
        with caplog.at_level(logging.WARNING, logger="engine.moe.store"):
            in_ram = ExpertStore(copy)
        try:
            assert in_ram.io_mode == "buffered" and not in_ram.direct
            assert "tmpfs" in in_ram.io_fallback_reason
            assert in_ram.io_info() == {"requested": "o_direct", "effective": "buffered",
                                        "fallback_reason": in_ram.io_fallback_reason}
            assert any("O_DIRECT is not in effect" in r.getMessage() and "tmpfs" in r.getMessage()
                       for r in caplog.records)
            got = aligned_buffer(in_ram.index.blob_bytes)
            in_ram.read_into(key, got)  # buffered reads still verify and give the same bytes
            assert bytes(got) == bytes(want)
        finally:
            in_ram.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_expert_store_falls_back_when_the_file_system_refuses_o_direct(tiny_store, monkeypatch, caplog):
    real_open = os.open

    def refusing_open(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(direct_io.os, "open", refusing_open)
    with caplog.at_level(logging.WARNING, logger="engine.moe.store"):
        s = ExpertStore(tiny_store)
    try:
        assert s.io_mode == "buffered" and not s.direct
        assert "refuses O_DIRECT" in s.io_fallback_reason and "Invalid argument" in s.io_fallback_reason
        assert any("O_DIRECT is not in effect" in r.getMessage() for r in caplog.records)
        s.read_into(s.keys[0], aligned_buffer(s.index.blob_bytes))
    finally:
        s.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.moe.store"):
        b = ExpertStore(tiny_store, StoreConfig(direct=False))  # buffered on purpose: no fallback, no warning
    try:
        assert b.io_info() == {"requested": "buffered", "effective": "buffered", "fallback_reason": None}
        assert not caplog.records
    finally:
        b.close()


# -- the benchmark -----------------------------------------------------------------------
def test_moe_bench_reports_consistent_figures():
    lines: list[str] = []
    out = moe.run(_args([*TINY, "--repeats", "2", "--concurrency", "1,2"]), lines.append)
    json.dumps(out)  # serialisable as the CLI writes it
    m = out["model"]
    assert m["layers"] == LAYERS and m["experts_per_layer"] == EXPERTS and m["top_k"] == 2
    assert m["expert_mb"] > 0 and m["all_experts_mb"] == pytest.approx(m["expert_mb"] * LAYERS * EXPERTS, abs=0.1)
    assert out["cache_fraction"] == 0.25
    assert out["cache_budget_mb"] == pytest.approx(m["all_experts_mb"] * 0.25, abs=0.1)
    assert out["tokens_per_request"] == 3 and out["repeats"] == 2

    io = out["io"]
    assert set(io) == {"requested", "effective", "fallback_reason"}
    assert io["requested"] == "o_direct" and io["effective"] in IO_MODES
    assert out["o_direct"] is (io["effective"] == "o_direct")  # the effective mode, not the request
    assert (io["fallback_reason"] is None) == (io["effective"] == "o_direct")

    assert len(out["disk_mb_s_per_repeat"]) == 2 and all(d > 0 for d in out["disk_mb_s_per_repeat"])
    assert out["disk_mb_s"] == pytest.approx(statistics.median(out["disk_mb_s_per_repeat"]), abs=0.1)

    res = out["results"]
    assert set(res) == SCHEDS
    for sched, by_conc in res.items():
        assert set(by_conc) == {"1", "2"}, sched
        for conc, r in by_conc.items():
            where = f"{sched} c={conc}"
            assert r["tok_s"] > 0 and r["s_per_token"] > 0 and r["tpot_s"] >= 0, where
            assert 0 <= r["hit_rate"] <= 1, where
            assert r["mb_per_token"] >= 0 and r["disk_mb_s_busy"] >= 0, where
            assert 0 <= r["compute_frac"] <= 1 and r["io_busy_frac"] >= 0, where
            assert 0 <= r["mean_group"] <= int(conc) and r["mean_batch"] >= 0, where
            # the disk's idle time by scheduler phase: with its busy time, most of the wall time. Neither
            # counts a read queued while no thread has taken it yet (a thread's wake-up: a real share with
            # these 0.1 MB reads) nor, for prefetch, wrong guesses still read after the answers are out.
            idle = {k: v for k, v in r.items() if k.startswith("disk_idle_") and k != "disk_idle_frac"}
            assert all(v >= 0 for v in idle.values()) and len(idle) == 7, where
            assert sum(idle.values()) == pytest.approx(r["disk_idle_frac"], abs=0.01), where
            assert 0.6 <= r["io_busy_frac"] + r["disk_idle_frac"] <= 1.05, where
            # compute by step: parts of the scheduler thread's compute (what is left is its bookkeeping);
            # the heap settled as chat and serve run it, every collection of the cyclic GC timed
            steps = [r[f"{p}_s_per_token"] for p in ("attention", "experts", "head")]
            assert all(x > 0 for x in steps) and sum(steps) <= r["compute_s_per_token"] + 1e-4, where
            assert r["gc_s_per_token"] >= 0, where
            # the synthetic model is f32 (matmuls widened: exact), so every scheduler gives on_demand's answers
            assert r["same_tokens_as_on_demand"] == 1.0, where
            if sched == "resident":  # every expert preloaded: nothing is read while measuring
                assert r["hit_rate"] == 1.0 and r["mb_per_token"] == 0.0, where
            else:  # the cache (25 %) starts empty: the experts a token needs must be read
                assert r["mb_per_token"] > 0, where

    # Speedups are the ratios of the reported figures (or refused, with the reason).
    assert out["concurrency_for_speedups"] == 2
    assert out["goals"] == {"speedup_vs_on_demand": 3.5, "speedup_vs_prefetch": 1.6, "bevy_vs_bound": 0.85}
    assert out["compute_bound_from"] == "resident run" and out["cap"] is None
    assert out["compute"] == "f32" and "token_ids" not in res["bevy"]["1"]  # answers compared, not kept
    assert out["torch_threads"] == (os.cpu_count() or 1)  # the engine's own: every core
    speedups = _speedup_keys(out)
    assert {("speedup_vs_on_demand",), ("speedup_vs_prefetch",), ("speedup_vs_on_demand_per_repeat",),
            ("speedup_vs_prefetch_per_repeat",)} <= set(speedups)
    if io["effective"] != "o_direct":  # e.g. FLOTILLA_CACHE on a tmpfs
        assert "page cache" in out["speedup_refused"]
        assert all(_get(out, k) is None for k in speedups)
        return
    assert "speedup_refused" not in out
    b = res["bevy"]["2"]["tok_s"]
    assert out["speedup_vs_on_demand"] == pytest.approx(b / res["on_demand"]["2"]["tok_s"], abs=1e-3)
    assert out["speedup_vs_prefetch"] == pytest.approx(b / res["prefetch"]["2"]["tok_s"], abs=1e-3)
    for key in ("speedup_vs_on_demand_per_repeat", "speedup_vs_prefetch_per_repeat"):
        assert len(out[key]) == 2 and all(x > 0 for x in out[key]), key

    bound = out["overlap_bound"]
    assert set(bound) == {"1", "2"}
    for c, row in bound.items():
        compute = res["resident"][c]["s_per_token"]
        rate = max([out["disk_mb_s"]] + [res[s][c]["disk_mb_s_busy"] for s in ("bevy", "on_demand", "prefetch")])
        assert row["disk_mb_s_used"] == pytest.approx(rate, abs=0.1)
        io_s = res["bevy"][c]["mb_per_token"] / row["disk_mb_s_used"]
        assert row["compute_s_per_token"] == pytest.approx(compute, abs=1e-4)
        assert row["io_s_per_token"] == pytest.approx(io_s, rel=1e-2, abs=1e-5)
        assert row["bound_s_per_token"] == pytest.approx(max(row["compute_s_per_token"], row["io_s_per_token"]),
                                                         abs=1e-5)
        assert row["serial_s_per_token"] == pytest.approx(
            compute + res["on_demand"][c]["mb_per_token"] / row["disk_mb_s_used"], rel=1e-2, abs=1e-4)
        assert row["max_speedup_vs_on_demand"] == pytest.approx(
            res["on_demand"][c]["s_per_token"] / row["bound_s_per_token"], rel=2e-2)
        for sched in ("bevy", "on_demand", "prefetch"):
            assert row[f"{sched}_s_per_token"] == res[sched][c]["s_per_token"]
            assert row[f"{sched}_vs_bound"] == pytest.approx(row["bound_s_per_token"] / res[sched][c]["s_per_token"],
                                                             rel=2e-2)
        bare = res["on_demand"][c]["compute_s_per_token"]  # on_demand computes with no read in flight
        assert row["compute_without_reads_s_per_token"] == pytest.approx(bare, abs=1e-5)
        strict = max(bare, row["io_s_per_token"])
        assert row["bevy_vs_strict_bound"] == pytest.approx(strict / res["bevy"][c]["s_per_token"], rel=2e-2)
    assert out["bevy_vs_bound"] == bound["2"]["bevy_vs_bound"]
    if bound["2"]["max_speedup_vs_on_demand"] < moe.PAPER_SPEEDUP_VS_ON_DEMAND:  # the JSON says by how much, why
        gap = out["paper_gap"]
        assert gap["short_by"] == pytest.approx(moe.PAPER_SPEEDUP_VS_ON_DEMAND / gap["max_speedup_vs_on_demand_here"],
                                                rel=1e-2)
        assert "overlap bound" in gap["why"]
    goal = out["goals"]["speedup_vs_prefetch"]
    if bound["2"]["max_speedup_vs_prefetch"] < goal:  # prefetch is too close to the bound for the goal
        gap = out["prefetch_gap"]
        assert gap["short_by"] == pytest.approx(goal / bound["2"]["max_speedup_vs_prefetch"], rel=1e-2)
        assert "overlap bound" in gap["why"] and f"{bound['2']['max_speedup_vs_prefetch']:.2f}x" in gap["why"]
    else:
        assert "prefetch_gap" not in out
    assert any("repeat 2/2" in line for line in lines)


def test_moe_bench_refuses_speedups_when_o_direct_is_not_in_effect(monkeypatch, caplog):
    # As if the store lived on tmpfs: O_DIRECT is requested, reads are buffered.
    monkeypatch.setattr(direct_io, "fs_type", lambda _path: "tmpfs")
    lines: list[str] = []
    with caplog.at_level(logging.WARNING, logger="engine.moe.store"):
        out = moe.run(_args([*TINY, "--repeats", "1", "--concurrency", "2"]), lines.append)
    json.dumps(out)
    assert out["io"]["requested"] == "o_direct" and out["io"]["effective"] == "buffered"
    assert "tmpfs" in out["io"]["fallback_reason"] and out["o_direct"] is False
    assert "O_DIRECT was requested" in out["speedup_refused"] and "tmpfs" in out["speedup_refused"]
    speedups = _speedup_keys(out)
    assert {("speedup_vs_on_demand",), ("speedup_vs_prefetch",),
            ("overlap_bound", "2", "max_speedup_vs_on_demand")} <= set(speedups)
    assert all(_get(out, k) is None for k in speedups), {k: _get(out, k) for k in speedups}
    assert out["goals"] == {"speedup_vs_on_demand": 3.5, "speedup_vs_prefetch": 1.6, "bevy_vs_bound": 0.85}
    assert out["compute_bound_from"] == "resident run" and out["cap"] is None  # targets stay
    assert all(r["tok_s"] > 0 for by_conc in out["results"].values() for r in by_conc.values())  # figures stay
    assert any("speedups refused" in line for line in lines)
    assert any("O_DIRECT is not in effect" in r.getMessage() for r in caplog.records)


def test_moe_bench_reports_speedups_of_a_buffered_run_asked_for():
    out = moe.run(_args([*TINY, "--repeats", "1", "--concurrency", "2", "--schedulers",
                         "bevy,on_demand,prefetch,bevy_verify_always,bevy_widened,bevy_native", "--buffered"]),
                  lambda _line: None)
    assert out["io"] == {"requested": "buffered", "effective": "buffered", "fallback_reason": None}
    assert out["o_direct"] is False and "speedup_refused" not in out
    res = out["results"]
    assert out["speedup_vs_on_demand"] == pytest.approx(res["bevy"]["2"]["tok_s"] / res["on_demand"]["2"]["tok_s"],
                                                        abs=1e-3)
    assert "overlap_bound" not in out  # no resident run, no bound
    # the variant beside Bevy: its own cell, its ratio over Bevy's, Bevy's answers
    assert out["bevy_over_verify_always"] == pytest.approx(
        res["bevy"]["2"]["tok_s"] / res["bevy_verify_always"]["2"]["tok_s"], abs=1e-3)
    assert res["bevy_verify_always"]["2"]["same_tokens_as_on_demand"] == res["bevy"]["2"]["same_tokens_as_on_demand"]
    widened = res["bevy"]["2"]["tok_s"] / res["bevy_widened"]["2"]["tok_s"]
    assert out["bevy_over_widened"] == pytest.approx(widened, abs=1e-3)
    assert out["bevy_over_widened_by_concurrency"] == {"2": pytest.approx(widened, abs=1e-3)}
    assert len(out["bevy_over_widened_per_repeat"]) == 1
    # f32 weights: "auto" widens them too, so Bevy's answers are the exact ones, and the one
    # way the matmuls ran is the JSON's `compute`
    assert res["bevy"]["2"]["same_tokens_as_widened"] == 1.0 and out["compute"] == "f32"
    # and torch's own product of f32 weights is that same f32 one
    assert out["bevy_over_native"] == pytest.approx(res["bevy"]["2"]["tok_s"] / res["bevy_native"]["2"]["tok_s"],
                                                    abs=1e-3)
    assert res["bevy"]["2"]["same_tokens_as_native"] == 1.0


def test_the_variants_are_bevy_with_one_setting_changed(tiny_store):
    from engine.bench._moe_runs import open_engine
    from engine.moe.scheduler import BevyScheduler

    for sched, verify, compute in (("bevy", "first", "auto"), ("bevy_verify_always", "always", "auto"),
                                   ("bevy_widened", "first", "f32"), ("bevy_native", "first", "native")):
        engine = open_engine(tiny_store, "tiny", sched, None, 2, True)
        try:
            assert isinstance(engine.scheduler, BevyScheduler) and engine.store.config.verify == verify
            assert engine.config.compute == compute
        finally:
            engine.close()


def test_moe_bench_on_a_demo_runs_every_engine_capped_above_its_setup():
    # `--shape demo`: the shipped demo MoE, each run a child whose memory group is capped once its
    # engine is set up at that usage + 16 MiB + the cache budget; the cache is the asked share
    out = moe.run(_args(["--shape", "demo", "--model", "demo-moe-random", "--tokens", "3", "--repeats", "1",
                         "--concurrency", "2", "--schedulers", "bevy,on_demand"]), lambda _line: None)
    assert out["model"]["recipe"] == "demo-moe-random" and out["model"]["shape"] == "demo"
    assert out["cache_fraction"] == pytest.approx(0.25, abs=0.01)
    cap = out["cap"]
    assert cap["rule"].startswith("above_setup") and cap["oom_kills"] == 0
    for sched in ("bevy", "on_demand"):
        cell = out["results"][sched]["2"]
        assert cell["setup_usage_mb"] > 50  # an interpreter with torch: it ran in its own capped group
        assert cell["group_limit_mb"] == pytest.approx(cell["setup_usage_mb"] + 16 * 2**20 / 1e6
                                                       + cap["cache_budget_mb"], abs=0.01)
        assert cell["setup_usage_mb"] <= cell["group_max_usage_mb"] <= cell["group_limit_mb"] + 0.01
        assert 0 <= cell["hit_rate"] <= 1 and cell["tok_s"] > 0
