"""The fleet's process handling on the path Windows takes, run here.

- The worker supervisor (engine/fleet/workers.py) starts workers with subprocess.Popen and
  threads, never asyncio subprocesses (a selector loop on Windows has none): its first-line,
  exit and stop handling on real processes; then the same with sys.platform faked as win32
  (a new process group, the kill-on-close Job object, CTRL_BREAK that cannot be delivered,
  psutil's kill).
- The agent's stop requests that every OS delivers: plain signal handlers, the end of stdin.
- Demo mode (engine/fleet/demo_mode.py): POSIX mode bits only where they mean something, and
  the demo's liveness through psutil, never os.kill(pid, 0) (CTRL_C_EVENT on Windows).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from engine import aio
from engine.fleet import demo_mode
from engine.fleet.agent_process import install_stop_signals, watch_stdin
from engine.transport.security import KeyPair
from engine.fleet.workers import WorkerSupervisor
from engine.platform import process, winjob
from tests.engine.fleet.fleet_helpers import ECHO_WORKER, REPO, free_port, process_gone

ECHO = ["{python}", str(ECHO_WORKER), "--shard", "{shard}", "--port", "{port}", "--device", "{device}"]
BOUND = ["{python}", "-c", "import json, time; print(json.dumps(dict(event='bound', "
         "endpoint='tcp://127.0.0.1:41234')), flush=True); print('more output', flush=True); time.sleep(120)"]
EXIT_AT_ONCE = ["{python}", "-c", "import sys; sys.exit(7)"]


def _shard(tmp_path):
    shard = tmp_path / "s.bin"
    shard.write_bytes(os.urandom(1000))
    return shard


async def _start(sup: WorkerSupervisor, shard, port: int = 0):
    return await sup.start("s", "ab" * 32, 1000, shard, "CPU", port)


def test_the_first_line_names_the_bound_port_and_the_rest_goes_to_the_log(tmp_path):
    sup = WorkerSupervisor(BOUND, tmp_path)

    async def main():
        w = await _start(sup, _shard(tmp_path))
        assert w.data_port == 41234 and w.info().state == "running"
        log = tmp_path / f"worker-{'ab' * 6}.log"
        for _ in range(200):
            if b"more output" in log.read_bytes():
                break
            await asyncio.sleep(0.02)
        assert b"more output" in log.read_bytes()  # stdout is drained: a full pipe would block the worker
        stopped = await sup.stop(w.sha256)
        assert stopped is w and w.exit_code == -signal.SIGTERM and process_gone(w.proc.pid)

    aio.run(main())


def test_a_worker_that_exits_at_once_is_reported_with_its_code(tmp_path):
    exits = []
    sup = WorkerSupervisor(EXIT_AT_ONCE, tmp_path, on_exit=exits.append)

    async def main():
        w = await _start(sup, _shard(tmp_path), port=5555)
        assert w.exit_code == 7 and w.data_port == 5555  # seen before start() returned
        assert w.info().state == "exited" and w.info().exit_code == 7
        assert exits == [w] and sup.running() == []

    aio.run(main())


def test_a_worker_stopped_by_us_is_no_exit_to_report(tmp_path):
    exits = []
    sup = WorkerSupervisor(ECHO + ["--ignore-term"], tmp_path, on_exit=exits.append)

    async def main():
        w = await _start(sup, _shard(tmp_path), free_port())
        await asyncio.sleep(0.5)  # let it start ignoring SIGTERM
        loop_alive = asyncio.get_running_loop().create_task(asyncio.sleep(0.05))
        await sup.stop_all(grace=0.3)
        assert loop_alive.done()  # the loop ran on while the stop waited
        assert w.exit_code == -signal.SIGKILL and process_gone(w.proc.pid)
        await asyncio.sleep(0.1)
        assert exits == []

    aio.run(main())


# ---------------------------------------------------------------- the same on Windows (faked)


@pytest.fixture
def windows(monkeypatch):
    """sys.platform = win32, with the OS calls that cannot run here faked at their boundary."""
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(process, "_job", None)
    seen = {"popen": [], "jobs": []}
    real_popen = subprocess.Popen

    def popen(argv, **kw):
        seen["popen"].append(dict(kw))
        kw.pop("creationflags", None)
        return real_popen(argv, start_new_session=True, **kw)

    real_kill = os.kill
    ctrl_break = object()

    def kill(pid, sig):
        if sig is ctrl_break:  # an agent started by the tray has no console to send it through
            seen.setdefault("ctrl_break", []).append(pid)
            raise OSError(6, "The handle is invalid")
        real_kill(pid, sig)

    class Job:
        def __init__(self):
            self.pids = []
            seen["jobs"].append(self)

        def add(self, pid):
            self.pids.append(pid)

    monkeypatch.setattr(process.subprocess, "Popen", popen)
    monkeypatch.setattr(signal, "CTRL_BREAK_EVENT", ctrl_break, raising=False)
    monkeypatch.setattr(os, "kill", kill)
    monkeypatch.setattr(winjob, "KillOnCloseJob", Job)
    return seen


def test_windows_workers_join_the_agents_job_and_are_killed_without_signals(windows, tmp_path):
    sup = WorkerSupervisor(ECHO + ["--ignore-term"], tmp_path)

    async def main():
        w = await _start(sup, _shard(tmp_path), free_port())
        await asyncio.sleep(0.5)
        await sup.stop(w.sha256, grace=0.3)
        return w

    w = aio.run(main())
    assert windows["popen"][0]["creationflags"] == process.CREATE_NEW_PROCESS_GROUP
    assert [j.pids for j in windows["jobs"]] == [[w.proc.pid]]  # dies with the agent, however it ends
    assert windows["ctrl_break"] == [w.proc.pid]  # asked first, to its group
    assert w.exit_code == -signal.SIGKILL and process_gone(w.proc.pid)  # then psutil's kill()


# ---------------------------------------------------------------- the agent's stop requests


def test_the_agent_stops_on_plain_signal_handlers():
    calls = []
    before = signal.getsignal(signal.SIGTERM)
    restore = install_stop_signals(lambda: calls.append("stop"))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            if calls:
                break
            time.sleep(0.01)
        assert calls == ["stop"]
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_agent_stops_when_its_stdin_ends():
    r, w = os.pipe()
    stops = []
    try:
        t = watch_stdin(lambda: stops.append(1), r)
        os.write(w, b"anything but the end\n")
        time.sleep(0.2)
        assert stops == [] and t.is_alive()
        os.close(w)  # the tray closed its end, or died
        t.join(5)
        assert stops == [1]
    finally:
        os.close(r)


def test_a_child_forked_while_the_agent_waits_on_stdin_can_close_it(tmp_path):
    # OpenVINO's telemetry forks a multiprocessing child from a thread of the agent; that child
    # closes sys.stdin first thing. With a buffered read of stdin blocked in another thread, the
    # fork inherits that read's lock held and hangs for ever (seen: orphaned agents' forks).
    code = ("import multiprocessing as mp, sys, time; from engine.fleet.agent_process import watch_stdin; "
            "watch_stdin(lambda: None); time.sleep(0.3); "
            "p = mp.get_context('fork').Process(target=print, args=('child ok',)); p.start(); p.join(10); "
            "print('exit', p.exitcode, flush=True)")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=str(REPO), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:  # stdin stays open (the watcher keeps waiting) until the fork has run
        lines = [p.stdout.readline().strip() for _ in range(2)]
    finally:
        p.stdin.close()
        if p.wait(30) is None:
            p.kill()
    assert lines == ["child ok", "exit 0"], lines


# ---------------------------------------------------------------- demo mode


@pytest.fixture
def demo_dir():
    root = demo_mode.make_demo_root()
    cfg = demo_mode.make_agent_dir(root, "agent-0", KeyPair.generate().public)
    yield root, cfg
    import shutil

    shutil.rmtree(root, ignore_errors=True)


def test_demo_dir_mode_bits_count_on_posix_only(demo_dir, monkeypatch):
    root, cfg = demo_dir
    os.chmod(root, 0o777)  # what a folder reads as on Windows, whatever its ACL
    os.chmod(cfg / demo_mode.MARKER, 0o666)
    with pytest.raises(ValueError, match="private config dir"):
        demo_mode.check_demo_dir(cfg, "127.0.0.1")
    monkeypatch.setattr(sys, "platform", "win32")
    grant = demo_mode.check_demo_dir(cfg, "127.0.0.1")
    assert grant.parent_pid == os.getpid() and grant.parent_created == psutil.Process().create_time()
    with pytest.raises(ValueError, match="127.0.0.1"):
        demo_mode.check_demo_dir(cfg, "*")  # still loopback only
    (cfg / "elsewhere").mkdir()
    with pytest.raises(ValueError, match="flotilla demo"):
        demo_mode.check_demo_dir(cfg / "elsewhere", "127.0.0.1")  # still only a demo root's child


def test_demo_parent_liveness_never_signals(monkeypatch):
    real_kill = os.kill

    def kill(pid, sig):  # psutil's own POSIX backend may probe with it; on Windows it does not
        if not sys._getframe(1).f_globals.get("__name__", "").startswith("psutil"):
            pytest.fail("os.kill(pid, 0) is CTRL_C_EVENT on Windows")
        real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    monkeypatch.setattr(sys, "platform", "win32")
    me = psutil.Process()
    assert demo_mode.parent_alive(demo_mode.DemoGrant("k", me.pid, me.create_time()))
    assert demo_mode.parent_alive(demo_mode.DemoGrant("k", me.pid))  # an old marker: the pid alone
    assert not demo_mode.parent_alive(demo_mode.DemoGrant("k", me.pid, me.create_time() - 60))  # pid reused
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not demo_mode.parent_alive(demo_mode.DemoGrant("k", p.pid))


def test_an_old_marker_without_the_parents_creation_time_still_works(demo_dir):
    root, cfg = demo_dir
    raw = json.loads((cfg / demo_mode.MARKER).read_text())
    del raw["parent_created"]
    (cfg / demo_mode.MARKER).write_text(json.dumps(raw))
    grant = demo_mode.check_demo_dir(cfg, "127.0.0.1")
    assert grant.parent_created == 0.0 and demo_mode.parent_alive(grant)
