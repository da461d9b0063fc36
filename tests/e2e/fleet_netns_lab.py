"""A throw-away LAN in network namespaces, for multi-process fleet tests.

  hub namespace: bridge br0 (multicast snooping off); node i's veth peer pI
                 is a port of br0, except "blocked" nodes, which hang off a
                 second bridge br1 joined to br0 by a veth pair (q0|q1) with
                 mcast_flood off on q1 and on their own port: unicast and
                 broadcast (ARP) pass, multicast does not, in either direction
                 (this kernel has no nft/iptables/tc drop action to do it with).
  node i:        namespace with vI = 10.231.X.(i+1)/24, X random per lab.

Nothing is created in the caller's namespace, no address outside the lab is
ever used, and cleanup() kills every process it spawned and deletes every
namespace (which takes the veths and bridges with them), also for labs left
behind by a test process that died.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

PREFIX = "fltlab-"


REPO = Path(__file__).resolve().parents[2]


def lab_env(config: Path) -> dict[str, str]:
    """The environment of a process in a lab namespace: this checkout, its own config folder,
    one fake CPU device, and the data folder under the config (never the user's)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    env["FLOTILLA_CONFIG"] = str(config)
    env["FLOTILLA_FLEET_DEVICES"] = "CPU=Lab CPU"
    env.pop("FLOTILLA_DATA", None)
    return env


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=20)


def available() -> str | None:
    """None if labs can be built here, else why not."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if not (shutil.which("ip") and shutil.which("bridge")):
        return "needs iproute2 (ip, bridge)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    try:
        _sh("ip", "netns", "add", probe)
    except (subprocess.SubprocessError, OSError) as e:
        return f"cannot create network namespaces: {e}"
    _sh("ip", "netns", "del", probe)
    return None


def reap_stale() -> None:
    """Delete labs whose creating process is gone (a crashed earlier run)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _kill_ns_procs(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _kill_ns_procs(ns: str) -> None:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in out.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class Proc:
    """A process in a lab namespace whose stdout/stderr lines are collected
    (with arrival times); JSON stdout lines are parsed into .events."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.events: list[dict] = []
        self.err: list[tuple[float, str]] = []
        threading.Thread(target=self._out, daemon=True).start()
        threading.Thread(target=self._errs, daemon=True).start()

    def _out(self) -> None:
        for line in self.popen.stdout:
            try:
                self.events.append(json.loads(line))
            except ValueError:
                pass

    def _errs(self) -> None:
        for line in self.popen.stderr:
            self.err.append((time.time(), line.rstrip()))

    def wait_for(self, pred: Callable[[], object], timeout: float) -> object:
        end = time.time() + timeout
        while time.time() < end:
            got = pred()
            if got:
                return got
            time.sleep(0.02)
        return pred()


class NetnsLab:
    def __init__(self, nodes: int, blocked: tuple[int, ...] = ()) -> None:
        self.n, self.blocked = nodes, set(blocked)
        self.tag = f"{PREFIX}{os.getpid()}-{random.randrange(16**4):04x}"
        self.hub = f"{self.tag}-h"
        self.subnet = random.randrange(1, 255)
        self.procs: list[Proc] = []

    def ns(self, i: int) -> str:
        return f"{self.tag}-{i}"

    def ip(self, i: int) -> str:
        return f"10.231.{self.subnet}.{i + 1}"

    def __enter__(self) -> NetnsLab:
        try:
            self._build()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def _build(self) -> None:
        h = self.hub
        _sh("ip", "netns", "add", h)
        for br in ("br0", "br1") if self.blocked else ("br0",):
            _sh("ip", "-n", h, "link", "add", br, "type", "bridge", "mcast_snooping", "0")
            _sh("ip", "-n", h, "link", "set", br, "up")
        if self.blocked:
            _sh("ip", "-n", h, "link", "add", "q0", "type", "veth", "peer", "name", "q1")
            _sh("ip", "-n", h, "link", "set", "q0", "master", "br0", "up")
            _sh("ip", "-n", h, "link", "set", "q1", "master", "br1", "up")
            _sh("bridge", "-n", h, "link", "set", "dev", "q1", "mcast_flood", "off")
        for i in range(self.n):
            ns = self.ns(i)
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", h, "link", "add", f"p{i}", "type", "veth", "peer", "name", f"v{i}",
                "netns", ns)
            _sh("ip", "-n", h, "link", "set", f"p{i}", "master", "br1" if i in self.blocked else "br0", "up")
            if i in self.blocked:
                _sh("bridge", "-n", h, "link", "set", "dev", f"p{i}", "mcast_flood", "off")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", f"v{i}")
            _sh("ip", "-n", ns, "link", "set", f"v{i}", "up")

    def spawn(self, i: int, argv: list[str], env: dict[str, str]) -> Proc:
        popen = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)
        proc = Proc(popen)
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                try:
                    os.killpg(p.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.popen.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait(5)
        for ns in [self.ns(i) for i in range(self.n)] + [self.hub]:
            _kill_ns_procs(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
