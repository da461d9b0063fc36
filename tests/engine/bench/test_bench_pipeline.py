"""`flotilla bench pipeline` on a tiny model: processes start, figures are sane, nothing is left behind.

No speed assertions: the real figures come from running the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("openvino")
pytest.importorskip("torch")
pytest.importorskip("zmq")

from engine.bench import _netns, pipeline  # noqa: E402
from engine.cli.bench_cmd import scenarios  # noqa: E402

TINY = ["--hidden", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--tokens", "3",
        "--repeats", "1", "--streams", "1,2"]
needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or shutil.which("taskset") is None,
                                     reason="needs 2 cores and taskset")


def _args(extra: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    pipeline.add_arguments(p)
    return p.parse_args(["--quick", *extra])


def _my_children() -> list[str]:
    """Command lines of live processes whose parent is this test process."""
    me = str(os.getpid())
    res = subprocess.run(["ps", "-eo", "ppid=,args="], capture_output=True, text=True)
    return [ln for ln in res.stdout.splitlines() if ln.split(None, 1)[0] == me and "ps -eo" not in ln]


def test_pipeline_scenario_is_discovered_and_private_modules_are_not():
    found = scenarios()
    assert found["pipeline"] is pipeline
    assert "_netns" not in found


@needs_two_cores
def test_pipeline_bench_reports_sane_figures(monkeypatch, tmp_path):
    before = os.sched_getaffinity(0)
    cores = sorted(before)[:2]
    monkeypatch.setattr(pipeline.tempfile, "tempdir", str(tmp_path))
    out = pipeline.run(_args([*TINY, "--cores", ",".join(map(str, cores))]), lambda _line: None)
    assert list(tmp_path.glob("flotilla-*")) == []  # a finished run removes the workers' logs
    json.dumps(out)
    assert os.sched_getaffinity(0) == before  # the bench process's pinning is undone
    assert out["model"]["layers"] == 4 and out["ranges"] == [[0, 2], [2, 4]]
    assert out["threads_per_process"] == 1 and out["cores"] == cores
    for name in ("monolithic", "monolithic_engine", "pipeline_2stages", "data_parallel"):
        assert set(out["aggregate_tok_s"][name]) == {"1", "2"}
        assert all(isinstance(v, float) and v > 0 for v in out["aggregate_tok_s"][name].values())
    assert isinstance(out["speedup_2streams"], float) and out["speedup_2streams"] > 0
    assert out["speedup_2streams"] == pytest.approx(
        out["aggregate_tok_s"]["pipeline_2stages"]["2"] / out["aggregate_tok_s"]["monolithic"]["1"], rel=1e-2)
    tok_s = out["aggregate_tok_s"]
    assert out["speedup_vs_monolithic"] == out["speedup_2streams"]
    assert out["pipeline_over_data_parallel"] == out["pipeline_over_data_parallel_by_streams"]["2"]
    assert set(out["pipeline_over_data_parallel_by_streams"]) == {"1", "2"}
    for n, ratio in out["pipeline_over_data_parallel_by_streams"].items():
        assert ratio == pytest.approx(tok_s["pipeline_2stages"][n] / tok_s["data_parallel"][n], rel=1e-2)
    assert out["data_parallel_streams_split"] == {"1": [1, 0], "2": [1, 1]}
    assert len(out["pipeline_over_data_parallel_per_repeat"]) == 1
    _check_pinning(out, cores, before)
    assert "network" not in out  # quick: loopback only
    assert len(out["stage_compute_ms_mean"]) == 2
    assert not [c for c in _my_children() if "engine.shards.worker" in c or "_child_main" in c]


def test_coordinator_gets_a_spare_core_or_shares_its_stages_cores():
    from engine.bench._replicas import plan_pinning, split_streams

    own = plan_pinning([0, 1], {0, 1, 2, 3})
    assert own["mode"] == "own_core" and own["coordinator"] == own["coordinator_1stage"] == [2]
    shared = plan_pinning([0, 1], {0, 1, 2, 3}, "shared")
    assert shared["mode"] == "shared_with_stages" and shared["coordinator"] == [0, 1]
    assert shared["coordinator_1stage"] == [0] and plan_pinning([0, 1], {0, 1})["coordinator"] == [0, 1]
    with pytest.raises(SystemExit):
        plan_pinning([0, 1], {0, 1}, "own")
    assert [split_streams(n, 2) for n in (1, 2, 3, 4)] == [[1, 0], [1, 1], [2, 1], [2, 2]]


def _check_pinning(out: dict, cores: list[int], allowed: set[int]) -> None:
    """Every process reported one valid share of cores; stages and replicas do not overlap."""
    pin = out["pinning"]
    assert pin["allowed"] == sorted(allowed) and isinstance(out["pinning_note"], str) and out["pinning_note"]
    stages = pin["pipeline_2stages"]["stages"]
    assert stages == [[cores[0]], [cores[1]]] and not set(stages[0]) & set(stages[1])
    assert pin["data_parallel"] == stages  # the replicas use the stage cores, one each
    assert pin["monolithic"] == [cores[0]] and pin["monolithic_engine"]["stages"] == [[cores[0]]]
    assert pin["curve_rings"]["stages"] == stages
    coord, coord1 = pin["pipeline_2stages"]["coordinator"], pin["monolithic_engine"]["coordinator"]
    assert pin["bench_process"] == pin["curve_rings"]["coordinator"] == coord
    for share in (coord, coord1, *stages):
        assert share and share == sorted(set(share)) and set(share) <= allowed
    spare = sorted(allowed - set(cores))
    if spare:  # a core of their own, away from every stage and baseline
        assert pin["coordinator_mode"] == "own_core" and coord == coord1 == [spare[0]]
    else:  # the cores of the stages each coordinator drives
        assert pin["coordinator_mode"] == "shared_with_stages"
        assert coord == sorted(cores) and coord1 == [cores[0]]


@pytest.mark.skipif(_netns.available() is not None, reason=str(_netns.available()))
def test_netlab_is_private_and_removed_even_on_error():
    tag = f"flbt{os.getpid()}"
    with pytest.raises(RuntimeError, match="boom"):
        with _netns.NetLab(["a", "b"], rate_mbit=300, tag=tag) as lab:
            assert sorted(_netns.existing(tag)) == sorted([f"{tag}-br", f"{tag}-a", f"{tag}-b"])
            assert lab.address("b") == "10.213.7.2"
            # The node sees only its own veth (and lo), with a private address and the tbf shaper.
            links = subprocess.run([*lab.exec_prefix("a"), "ip", "-o", "addr"], capture_output=True, text=True).stdout
            assert "10.213.7.1/24" in links and "eth0" in links
            qdisc = subprocess.run([*lab.exec_prefix("a"), "tc", "qdisc", "show", "dev", "eth0"],
                                   capture_output=True, text=True).stdout
            assert "tbf" in qdisc
            raise RuntimeError("boom")
    assert _netns.existing(tag) == []


@pytest.mark.skipif(_netns.available() is not None, reason=str(_netns.available()))
def test_relay_adds_the_delay_both_ways():
    tag = f"flbr{os.getpid()}"
    with _netns.NetLab(["a", "b"], tag=tag) as lab:
        echo = subprocess.Popen([*lab.exec_prefix("b"), sys.executable, "-c", (
            "import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            "s.bind(('10.213.7.2', 7001)); s.listen(); print('up', flush=True); c, _ = s.accept()\n"
            "while True:\n    d = c.recv(65536)\n    if not d: break\n    c.sendall(d)\n")],
            stdout=subprocess.PIPE, text=True)
        relay = subprocess.Popen([*lab.exec_prefix("b"), sys.executable, "-m", "engine.bench._netns", "relay",
                                  "--listen", "10.213.7.2:0", "--to", "10.213.7.2:7001", "--delay-ms", "20"],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert echo.stdout.readline().strip() == "up"
            port = json.loads(relay.stdout.readline())["endpoint"].rsplit(":", 1)[1]
            probe = subprocess.run([*lab.exec_prefix("a"), sys.executable, "-c", (
                "import socket, time\n"
                f"s = socket.create_connection(('10.213.7.2', {port}))\n"
                "t = time.perf_counter(); s.sendall(b'x' * 4096); n = 0\n"
                "while n < 4096: n += len(s.recv(65536))\n"
                "print((time.perf_counter() - t) * 1000)\n")], capture_output=True, text=True, timeout=30)
            rtt = float(probe.stdout.strip())
            assert 38 <= rtt < 400, rtt  # 20 ms each way, plus scheduling on a busy machine
        finally:
            relay.kill()
            echo.kill()
            relay.wait()
            echo.wait()
    assert _netns.existing(tag) == []
