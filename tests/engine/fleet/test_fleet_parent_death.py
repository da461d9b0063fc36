"""Shard workers never outlive their agent, however it ends.

- Killed outright (SIGKILL: no cleanup runs, as with TerminateProcess on Windows): each real
  pipeline worker's parent watch (engine/shards/worker.py, pid + creation time through psutil,
  the mechanism Windows relies on too) ends it within seconds -- here while the dead agent is
  still an unreaped zombie, which counts as gone.
- Stopped by its tray ("Quit (stop sharing this PC)": engine/client/agent.py AgentHandle.stop): the
  agent is asked, through its stdin lifeline, the same way on every OS, and stops its workers
  itself before it exits; nothing is killed. Its lifeline also ends when the tray dies.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from engine.fleet.client import AgentClient, sha256_file
from engine.transport.security import KeyPair
from tests.engine.fleet.fleet_helpers import REPO, AgentProc, fleet_env, free_port, pair, process_gone

GONE_WITHIN_S = 5.0  # the watch polls every 0.5 s


def _wait(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_killed_agents_pipeline_worker_exits_by_its_parent_watch(tmp_path, demo_dir):
    pytest.importorskip("openvino")
    from engine.fleet.bundle import cached_bundle
    from engine.models.demo import cache_root
    from engine.shards.export import ensure_shard

    info = ensure_shard(demo_dir("demo"), 0, 8, num_layers_total=8)
    bundle, sha = cached_bundle(Path(info.path), cache_root() / "bundles")
    agent = AgentProc(tmp_path, real_worker=True).start()  # the agent's own default: engine.shards.worker
    try:
        async def load() -> int:
            me = KeyPair.generate()
            await pair(agent, me)
            async with AgentClient(me, agent.control, agent.public_key, timeout=90) as c:
                await c.send_shard(bundle, "demo/L0-8", sha=sha)
                return (await c.load(sha, "CPU", 0)).shard.pid

        pid = asyncio.run(load())
        assert psutil.Process(pid).ppid() == agent.proc.pid and "engine.shards.worker" in \
            psutil.Process(pid).cmdline()
        os.kill(agent.proc.pid, signal.SIGKILL)  # no cleanup at all; we do not reap it yet
        assert _wait(lambda: process_gone(pid), GONE_WITHIN_S), "the worker outlived its killed agent"
        assert psutil.Process(agent.proc.pid).status() == psutil.STATUS_ZOMBIE  # the watch saw through it
        logs = list(tmp_path.rglob(f"worker-{sha[:12]}.log"))
        assert len(logs) == 1
        assert f"parent process {agent.proc.pid} is gone; exiting" in logs[0].read_text(errors="replace")
    finally:
        agent.stop(kill=True)


def _handle_agent(tmp_path, monkeypatch):
    """An agent started the way the tray starts it (AgentHandle.spawn), with the echo worker."""
    from engine import client

    agent = AgentProc(tmp_path)  # its config, policy, idle file and port; started below instead
    for k, v in fleet_env(agent.config).items():
        monkeypatch.setenv(k, v)
    argv = ["--bind", "127.0.0.1", "--port", str(agent.base), "--idle-source", f"file:{agent.idle_file}",
            "--no-mdns", "--worker-cmd", agent.worker_cmd]
    handle = client.AgentHandle.spawn(argv, config=agent.config)
    agent.proc = handle.proc
    return agent, handle


def test_quit_in_the_tray_lets_the_agent_stop_its_workers(tmp_path, monkeypatch):
    agent, handle = _handle_agent(tmp_path, monkeypatch)
    try:
        async def load() -> int:
            me = KeyPair.generate()
            await pair(agent, me)
            async with AgentClient(me, agent.control, agent.public_key) as c:
                shard = tmp_path / "s.bin"
                shard.write_bytes(os.urandom(100_000))
                await c.send_shard(shard, "s")
                return (await c.load(sha256_file(shard), "CPU", free_port())).shard.pid

        pid = asyncio.run(load())
        assert handle.state().workers == 1
        handle.stop(timeout=20)
        assert handle.proc.returncode == 0  # it exited by itself: not killed
        assert process_gone(pid)  # the echo worker watches nothing: only the agent's cleanup ends it
        lines = list(handle.lines)
        assert any("stdin closed: stopping" in ln for ln in lines), lines[-10:]
        assert any("agent stopped" in ln for ln in lines), lines[-10:]
    finally:
        agent.stop(kill=True)


def test_an_agent_does_not_outlive_the_tray_that_started_it(tmp_path):
    agent = AgentProc(tmp_path)
    tray = ("import sys; from pathlib import Path; from engine import client; "
            "h = client.AgentHandle.spawn(sys.argv[2:], config=Path(sys.argv[1])); "
            "print(h.pid, flush=True); sys.stdin.read()")
    argv = [str(agent.config), "--bind", "127.0.0.1", "--port", str(agent.base), "--idle-source",
            f"file:{agent.idle_file}", "--no-mdns", "--worker-cmd", agent.worker_cmd]
    p = subprocess.Popen([sys.executable, "-c", tray, *argv], env=fleet_env(agent.config), cwd=REPO,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    agent_pid = None
    try:
        agent_pid = int(p.stdout.readline())
        assert psutil.Process(agent_pid).ppid() == p.pid
        p.kill()  # the tray crashes
        p.wait(5)
        assert _wait(lambda: process_gone(agent_pid), 20), "the agent outlived its tray"
        log = "".join(f.read_text(errors="replace") for f in tmp_path.rglob("agent.log*"))
        assert "stdin closed: stopping" in log and "agent stopped" in log  # a clean stop, not a crash
    finally:
        if p.poll() is None:
            p.kill()
        if agent_pid is not None and not process_gone(agent_pid):
            psutil.Process(agent_pid).kill()
