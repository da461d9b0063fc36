"""Helpers of the fleet tests: run a real agent process on loopback and pair with it."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ECHO_WORKER = Path(__file__).with_name("fleet_echo_worker.py")


def free_base_port() -> int:
    """A base port whose base..base+2 are free on 127.0.0.1."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base > 65000:
            continue
        try:
            socks = []
            for p in range(base, base + 3):
                t = socket.socket()
                t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                t.bind(("127.0.0.1", p))
                socks.append(t)
            for t in socks:
                t.close()
            return base
        except OSError:
            for t in socks:
                t.close()
    raise RuntimeError("no free port range")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fleet_env(config: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["FLOTILLA_CONFIG"] = str(config)
    env["FLOTILLA_FLEET_DEVICES"] = "CPU=Test CPU;GPU.0=Test GPU"
    return env


def process_gone(pid: int) -> bool:
    """True once pid has exited (a zombie counts: its parent has not reaped it yet).
    Race-free: the process may vanish between any two /proc reads."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def set_idle(path: Path, seconds_ago: float) -> None:
    """The user's last input was seconds_ago (0 = the user is back now)."""
    path.write_text(f"{time.time() - seconds_ago}\n")


class AgentProc:
    """`python -m engine.cli.agent_cmd --headless` on loopback, no mDNS."""

    def __init__(self, tmp: Path, *, base: int | None = None, worker_args: str = "",
                 mdns: bool = False, real_worker: bool = False) -> None:
        self.config = tmp / "agent"
        self.config.mkdir(parents=True, exist_ok=True)
        self.idle_file = tmp / "idle"
        if not self.idle_file.exists():
            set_idle(self.idle_file, 3600)
        # The test machine may be busy (other suites run beside this one): do not
        # let its CPU load refuse our loads. NPU is left out to test the device rule.
        from engine.fleet.policy import SharingPolicy

        if not (self.config / "sharing_policy.json").exists():
            SharingPolicy(max_cpu_percent_to_start=100.0, devices=("CPU", "GPU")).save(self.config)
        self.base = base or free_base_port()
        self.worker_cmd = (f"{{python}} {ECHO_WORKER} --shard {{shard}} --port {{port}} "
                           f"--device {{device}} {worker_args}")
        self.mdns = mdns
        self.real_worker = real_worker  # the pipeline worker (pipeline_worker_command), not the echo one
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []

    def start(self, timeout: float = 20.0) -> AgentProc:
        argv = [sys.executable, "-m", "engine.cli.agent_cmd", "--headless", "-v",
                "--bind", "127.0.0.1", "--port", str(self.base),
                "--idle-source", f"file:{self.idle_file}"]
        argv += [] if self.real_worker else ["--worker-cmd", self.worker_cmd]
        argv += ["--interface", "127.0.0.1"] if self.mdns else ["--no-mdns"]
        self.proc = subprocess.Popen(argv, env=fleet_env(self.config), cwd=REPO,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        up = threading.Event()

        def pump() -> None:
            for line in self.proc.stderr:
                self.lines.append(line.rstrip())
                if " up: control " in line:
                    up.set()

        threading.Thread(target=pump, daemon=True).start()
        if not up.wait(timeout):
            self.stop()
            raise RuntimeError("agent did not start:\n" + "\n".join(self.lines[-20:]))
        return self

    @property
    def control(self) -> str:
        return f"tcp://127.0.0.1:{self.base}"

    @property
    def pairing(self) -> str:
        return f"tcp://127.0.0.1:{self.base + 1}"

    @property
    def public_key(self) -> str:
        return (self.config / "node_key.public").read_text().strip()

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "engine.cli.agent_cmd", *args],
                              env=fleet_env(self.config), cwd=REPO, capture_output=True,
                              text=True, timeout=60)

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


async def pair(agent: AgentProc, keys, name: str = "test-controller") -> None:
    """Pair keys with agent the way a user does: request, accept the code on
    the agent with the CLI, request again."""
    from engine.fleet.client import async_pair
    from engine.transport.security import pairing_code

    first = await async_pair(keys, agent.pairing, agent.public_key, name)
    assert first.state == "pending"
    assert first.code == pairing_code(agent.public_key, keys.public)
    done = await asyncio.to_thread(agent.cli, "pair", "--accept", first.code)
    assert done.returncode == 0, done.stderr
    second = await async_pair(keys, agent.pairing, agent.public_key, name)
    assert second.state == "accepted"


async def loopback_peer(agent: AgentProc):
    """The agent as discovery reports it (a Peer on 127.0.0.1), from its info port directly."""
    import zmq.asyncio

    from engine.fleet.discovery import INFO_OFFSET, Peer, async_query_info

    ctx = zmq.asyncio.Context()
    try:
        info = await async_query_info(ctx, "127.0.0.1", agent.base + INFO_OFFSET)
    finally:
        ctx.term()
    return Peer(info, ("127.0.0.1",), "manual", time.time())


def paired_agents(tmp: Path, n: int):
    """n agents with the real pipeline worker, started in parallel (each imports OpenVINO) and
    paired with a fresh controller key: (agents, keys, peers). The caller stops the agents;
    they are stopped here if pairing fails."""
    from engine.transport.security import KeyPair

    procs = [AgentProc(tmp / f"n{i}", real_worker=True) for i in range(n)]
    starters = [threading.Thread(target=a.start) for a in procs]
    for t in starters:
        t.start()
    for t in starters:
        t.join()
    keys = KeyPair.generate()

    async def setup():
        await asyncio.gather(*(pair(a, keys) for a in procs))
        return [await loopback_peer(a) for a in procs]

    try:
        return procs, keys, asyncio.run(setup())
    except BaseException:
        for a in procs:
            a.stop()
        raise
