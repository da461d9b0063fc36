"""Network faults between pipeline stages, in private network namespaces.

Lab (engine/bench/_netns.NetLab): namespaces c (coordinator), s0 s1 s2
(stages) and r0 (a spare peer), bridged; nothing touches the host's network
and every namespace is deleted at the end. One driver process in c runs the
pipeline (tests/e2e/rel_netfault_driver.py); between its rounds the test
breaks the network:

1. a 1 s blip (`ip link set eth0 down`, then up) on s1: shorter than the
   ping timeout, so no recovery; TCP and ZeroMQ carry on; answers identical;
2. packet loss on s1: `tc netem loss` when the kernel has sch_netem;
   otherwise (this CI kernel has no netem and no drop action) a tbf qdisc so
   small that it drops most packets of every burst: real loss, real TCP
   retransmissions. The streams complete (recovered or not), never hang;
3. s1's link down for good: detected by missing pongs within 3 s, the stage
   is restarted on r0, every stream completes identically;
4. s0's link down, no spare left: every stream ends within seconds with an
   error that names the stage and says no peer can host it; the next
   request is refused with that reason.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("openvino")
pytest.importorskip("zmq")

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent


def _netlab():
    from engine.bench import _netns

    why = _netns.available()
    if why:
        pytest.skip(why)
    return _netns


def _has_netem(netns) -> bool:
    """Probe in a throw-away namespace of our own."""
    name = f"flrelprobe{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        res = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                              "loss", "1%"], capture_output=True)
        return res.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


class Driver:
    def __init__(self, lab, spec: dict) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([*lab.exec_prefix("c"), sys.executable, str(HERE / "rel_netfault_driver.py"),
                                      json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(Path(spec["log_dir"]) / "driver.log", "ab"), text=True,
                                     env=env, cwd=str(REPO))
        self.t0 = time.monotonic()
        self.lines: queue.Queue = queue.Queue()

        def pump() -> None:  # a thread: select() would miss lines already in the pipe's buffer
            for line in self.proc.stdout:
                self.lines.put(line)
            self.lines.put("")

        threading.Thread(target=pump, daemon=True).start()

    def read(self, event: str, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {event!r} from the driver within {timeout} s (a hang)") from None
            assert line, "the driver died"
            msg = json.loads(line)
            if msg["event"] == event:
                print(f"[{time.monotonic() - self.t0:6.1f} s] {event}")
                return msg

    def round(self, streams: int) -> None:
        self.proc.stdin.write(json.dumps({"cmd": "round", "streams": streams}) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.proc.kill()
            self.proc.wait()


def _ip(lab, node: str, *args: str) -> None:
    subprocess.run(["ip", "-n", lab.ns(node), *args], check=True, capture_output=True)


def _tc(lab, node: str, *args: str) -> None:
    subprocess.run([*lab.exec_prefix(node), "tc", *args], check=True, capture_output=True)


def test_pipeline_survives_or_reports_network_faults(tmp_path):
    netns = _netlab()
    from engine.models.demo import ensure_demo
    from engine.pipeline.runner import FleetConfig, LocalFleet

    ensure_demo("demo")
    fleet = LocalFleet(FleetConfig(model="demo", stages=3, exact=True))  # plans; exports below; starts nothing
    infos = fleet.export()
    nodes = ["c", "s0", "s1", "s2", "r0"]
    with netns.NetLab(nodes, tag=f"flrel{os.getpid() % 100000}") as lab:
        spec = {"stages": [[lab.exec_prefix(f"s{i}"), lab.address(f"s{i}")] for i in range(3)],
                "spares": [[lab.exec_prefix("r0"), lab.address("r0")]],
                "coord_addr": lab.address("c"), "shards": [str(i.path) for i in infos],
                "ranges": [[s.start, s.end] for s in fleet.plan.stages], "model_dir": str(fleet.model_path),
                "max_streams": 4, "max_tokens": 300, "stream_timeout_s": 60, "log_dir": str(tmp_path)}
        driver = Driver(lab, spec)
        try:
            driver.read("ready", timeout=180)

            # 1. a blip shorter than the ping timeout: no recovery, nothing lost
            driver.round(2)
            driver.read("streaming")
            _ip(lab, "s1", "link", "set", "eth0", "down")
            time.sleep(1.0)
            _ip(lab, "s1", "link", "set", "eth0", "up")
            res = driver.read("result")
            print("\nblip:", res)
            assert all(res["identical"]) and res["records"] == [], res

            # 2. packet loss on s1
            netem = _has_netem(netns)
            if netem:
                _tc(lab, "s1", "qdisc", "add", "dev", "eth0", "root", "netem", "loss", "20%")
            else:  # a bucket this small drops most of each burst
                _tc(lab, "s1", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "200kbit", "burst", "1600",
                    "limit", "1600")
            driver.round(2)
            driver.read("streaming", timeout=90)
            res = driver.read("result", timeout=150)
            _tc(lab, "s1", "qdisc", "del", "dev", "eth0", "root")
            print(f"loss ({'netem 20%' if netem else 'tbf drops'}):", res)
            for ok, (reason, error) in zip(res["identical"], res["finals"].values()):
                assert reason != "hang", error
                assert ok or (reason == "error" and error), res  # completed exactly, or said why

            # 3. s1 gone for good: pongs stop, the stage restarts on r0
            driver.round(4)
            driver.read("streaming", timeout=90)
            t_down = time.monotonic()
            _ip(lab, "s1", "link", "set", "eth0", "down")
            res = driver.read("result")
            print("outage:", res)
            assert all(res["identical"]) and len(res["identical"]) == 4, res
            rec = res["records"][-1]
            assert rec["ok"] and rec["lost"] == [1] and "stopped answering" in rec["reason"]
            detect = rec["detected"] - t_down
            print(f"outage: detected after {detect:.2f} s, resumed {rec['resume_s']:.2f} s later")
            assert detect <= 3.2, detect

            # 4. s0 gone and no spare left: a clear error, quickly, no hang
            driver.round(2)
            driver.read("streaming", timeout=90)
            t_down = time.monotonic()
            _ip(lab, "s0", "link", "set", "eth0", "down")
            res = driver.read("result", timeout=60)
            print("no peer left:", res)
            assert time.monotonic() - t_down < 10
            for reason, error in res["finals"].values():
                assert reason == "error" and "stage 0" in error and "no peer is left" in error, error
            assert res["state"] == "broken"
            driver.round(1)
            res = driver.read("result", timeout=30)
            assert "no peer is left" in res.get("refused", ""), res
        finally:
            driver.close()
    assert not netns.existing(lab.tag), "namespaces left behind"
