"""engine/platform/process.py: the one spawn / stop / watch mechanism, on real processes.

The POSIX path runs as it does in production. The Windows path runs here with sys.platform
faked as win32: its psutil kill and terminate are the same calls on Linux, and the Windows-only
pieces (CTRL_BREAK_EVENT, the kill-on-close Job object through kernel32) are faked at the OS
boundary, so their call sequence is what is checked.
"""

from __future__ import annotations

import ast
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from engine.platform import process, winjob

REPO = Path(__file__).resolve().parents[3]
SLEEPER = "import time; time.sleep(120)"
# Ignores SIGTERM, starts a grandchild that ignores it too, prints the grandchild's pid.
HUNG_TREE = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
             "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(120)'], "
             "stdout=subprocess.PIPE); g.stdout.readline(); print(g.pid, flush=True); time.sleep(120)")


def _py(code: str, **kw) -> subprocess.Popen:
    return process.spawn([sys.executable, "-c", code], **kw)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _gone(pid):
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def cleanup():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(5)


# ---------------------------------------------------------------- POSIX (this machine)


def test_spawn_starts_the_child_in_its_own_session_and_group(cleanup):
    p = _py(SLEEPER)
    cleanup.append(p)
    assert os.getpgid(p.pid) == p.pid and os.getsid(p.pid) == p.pid  # a terminal's Ctrl-C misses it
    assert process.group_kwargs() == {"start_new_session": True}


def test_stop_is_graceful_first(cleanup):
    p = _py(SLEEPER)
    cleanup.append(p)
    assert process.stop(p, grace=10.0) == -signal.SIGTERM  # it exited on the request: never killed


def test_a_hung_process_and_its_children_are_killed_after_the_grace(cleanup):
    p = _py(HUNG_TREE, stdout=subprocess.PIPE)
    cleanup.append(p)
    grandchild = int(p.stdout.readline())
    assert psutil.Process(grandchild).ppid() == p.pid
    assert process.stop(p, grace=0.3) == -signal.SIGKILL
    assert _wait_gone(grandchild, 5), "the grandchild outlived the kill"


def test_stop_uses_the_callers_request_and_does_not_kill_a_process_that_complies(cleanup):
    p = _py("import sys; sys.stdin.read(); sys.exit(0)", stdin=subprocess.PIPE)
    cleanup.append(p)
    assert process.stop(p, grace=10.0, ask=p.stdin.close) == 0


def test_stop_all_asks_all_then_kills_the_ones_that_hang(cleanup):
    calm, hung = _py(SLEEPER), _py(HUNG_TREE, stdout=subprocess.PIPE)
    cleanup += [calm, hung]
    int(hung.stdout.readline())  # SIGTERM is ignored from here on
    assert process.stop_all([calm, hung], grace=0.5) == [-signal.SIGTERM, -signal.SIGKILL]
    assert process.stop_all([calm, hung]) == [-signal.SIGTERM, -signal.SIGKILL]  # idempotent


def test_a_process_ref_is_a_pid_and_its_creation_time(cleanup):
    me = process.ProcessRef.of(os.getpid())
    assert me is not None and me.alive() and me.created == psutil.Process().create_time()
    # The same pid with another creation time is another process (a reused pid): not alive.
    assert not process.ProcessRef(me.pid, me.created + 5.0).alive()
    p = _py("pass")
    cleanup.append(p)
    ref = process.ProcessRef.of(p.pid) or process.ProcessRef(p.pid, 0.0)
    while psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    assert not ref.alive() and process.ProcessRef.of(p.pid) is None  # exited, not reaped yet: gone
    p.wait()
    assert not ref.alive() and process.ProcessRef.of(p.pid) is None


def test_parent_ref_refuses_a_pid_younger_than_us(cleanup):
    assert process.parent_ref(os.getppid()) is not None  # our real parent
    time.sleep(max(0.0, psutil.Process().create_time() + process.BORN_SLACK_S + 0.1 - time.time()))
    child = _py(SLEEPER)
    cleanup.append(child)
    # Created after us, so it cannot be our parent: a parent pid that points at it was reused.
    assert process.parent_ref(child.pid) is None
    assert process.parent_ref(child.pid + 10_000_000) is None  # no such process


def test_watch_follows_any_process_not_only_the_parent(cleanup):
    # Not our child's parent, not our parent: a getppid() comparison could not watch it at all.
    p = _py(SLEEPER)
    cleanup.append(p)
    fired = []
    t = process.watch(process.ProcessRef.of(p.pid), lambda: fired.append(time.monotonic()), interval=0.05)
    time.sleep(0.3)
    assert not fired and t.is_alive()
    p.kill()  # it ends while still unreaped (a zombie): that is gone too
    t.join(5)
    assert fired and not t.is_alive()
    p.wait()
    gone = []
    process.watch(None, lambda: gone.append(1)).join(5)
    assert gone == [1]


def test_no_sigkill_or_killpg_outside_the_process_module():
    allowed = {REPO / "engine" / "platform" / "process.py"}
    bad = []
    for path in (REPO / "engine").rglob("*.py"):
        if path in allowed or (REPO / "engine" / "bench") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    (node.value.id, node.attr) in {("signal", "SIGKILL"), ("os", "killpg"), ("os", "getppid")}:
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "use engine.platform.process (psutil kill, pid + creation time) instead:\n" + "\n".join(bad)


# ---------------------------------------------------------------- Windows (faked)


@pytest.fixture
def windows(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(process, "_job", None)


def test_windows_spawn_asks_for_a_new_process_group_and_the_job(windows, monkeypatch, cleanup):
    seen = []
    real_popen = subprocess.Popen

    def popen(argv, **kw):  # record what Windows would get, then run it here the POSIX way
        seen.append(dict(kw))
        kw.pop("creationflags")
        return real_popen(argv, start_new_session=True, **kw)

    jobs = []

    class Job:
        def __init__(self):
            self.pids = []
            jobs.append(self)

        def add(self, pid):
            self.pids.append(pid)

    monkeypatch.setattr(process.subprocess, "Popen", popen)
    monkeypatch.setattr(winjob, "KillOnCloseJob", Job)
    no_window = 0x08000000  # CREATE_NO_WINDOW: a caller's own flag is kept
    a = process.spawn([sys.executable, "-c", SLEEPER], die_with_us=True, creationflags=no_window)
    b = process.spawn([sys.executable, "-c", SLEEPER], die_with_us=True)
    cleanup += [a, b]
    assert [kw["creationflags"] for kw in seen] == [no_window | process.CREATE_NEW_PROCESS_GROUP,
                                                   process.CREATE_NEW_PROCESS_GROUP]
    assert not any("start_new_session" in kw for kw in seen)
    assert len(jobs) == 1 and jobs[0].pids == [a.pid, b.pid]  # one job for all, alive as long as we are
    c = process.spawn([sys.executable, "-c", SLEEPER], hidden=True)  # the tray's agent: no console window
    cleanup.append(c)
    assert seen[-1]["creationflags"] == process.CREATE_NO_WINDOW | process.CREATE_NEW_PROCESS_GROUP


def test_windows_interrupt_sends_ctrl_break_to_the_group_spawn_made(windows, monkeypatch, cleanup):
    sent, terminated = [], []
    ctrl_break = object()
    monkeypatch.setattr(signal, "CTRL_BREAK_EVENT", ctrl_break, raising=False)
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(os, "killpg", lambda *a: pytest.fail("no process groups by signal on Windows"))
    monkeypatch.setattr(process, "_psutil_call", lambda pid, method: terminated.append((pid, method)))
    monkeypatch.setattr(process, "_group_leaders", {4321})
    process.interrupt(4321)
    assert sent == [(4321, ctrl_break)] and terminated == []
    # A pid that leads no group of ours: CTRL_BREAK would reach our whole console, us included.
    process.interrupt(4322)
    assert sent == [(4321, ctrl_break)] and terminated == [(4322, "terminate")]


def test_windows_interrupt_without_a_console_terminates_through_psutil(windows, monkeypatch, cleanup):
    p = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    cleanup.append(p)

    real_kill = os.kill
    ctrl_break = object()  # only the fake knows it

    def no_console(pid, sig):
        if sig is ctrl_break:  # GenerateConsoleCtrlEvent without a shared console
            raise OSError(6, "The handle is invalid")
        real_kill(pid, sig)  # psutil's terminate() on this POSIX machine

    monkeypatch.setattr(signal, "CTRL_BREAK_EVENT", ctrl_break, raising=False)
    monkeypatch.setattr(os, "kill", no_console)
    monkeypatch.setattr(process, "_group_leaders", {p.pid})
    process.interrupt(p)
    assert p.wait(10) == -signal.SIGTERM  # psutil terminate(): TerminateProcess on Windows


def test_windows_kill_tree_uses_psutil_only(windows, monkeypatch, cleanup):
    p = subprocess.Popen([sys.executable, "-c", HUNG_TREE], stdout=subprocess.PIPE, start_new_session=True)
    cleanup.append(p)
    grandchild = int(p.stdout.readline())
    monkeypatch.setattr(os, "killpg", lambda *a: pytest.fail("no process groups by signal on Windows"))
    process.kill_tree(p)
    assert p.wait(5) == -signal.SIGKILL
    assert _wait_gone(grandchild, 5)


def test_windows_stop_kills_a_process_that_ignores_the_request(windows, monkeypatch, cleanup):
    p = subprocess.Popen([sys.executable, "-c", HUNG_TREE], stdout=subprocess.PIPE, start_new_session=True)
    cleanup.append(p)
    grandchild = int(p.stdout.readline())
    assert process.stop(p, grace=0.3) == -signal.SIGKILL
    assert _wait_gone(grandchild, 5)


# ---------------------------------------------------------------- the Job object (kernel32 faked)


class FakeKernel32:
    """Records each call with the values Windows would see; fail = the call that returns 0."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def _ret(self, name, value):
        return 0 if name == self.fail else value

    def CreateJobObjectW(self, attrs, name):  # noqa: N802 - the Windows names
        self.calls.append(("CreateJobObjectW", attrs, name))
        return self._ret("CreateJobObjectW", 100)

    def SetInformationJobObject(self, job, klass, info, size):  # noqa: N802
        limits = info._obj.BasicLimitInformation.LimitFlags  # byref(JOBOBJECT_EXTENDED_LIMIT_INFORMATION)
        self.calls.append(("SetInformationJobObject", job, klass, limits, size))
        return self._ret("SetInformationJobObject", 1)

    def OpenProcess(self, access, inherit, pid):  # noqa: N802
        self.calls.append(("OpenProcess", access, inherit, pid))
        return self._ret("OpenProcess", 200)

    def AssignProcessToJobObject(self, job, proc):  # noqa: N802
        self.calls.append(("AssignProcessToJobObject", job, proc))
        return self._ret("AssignProcessToJobObject", 1)

    def CloseHandle(self, handle):  # noqa: N802
        self.calls.append(("CloseHandle", handle))
        return 1


def test_job_kills_on_close_and_takes_processes_in():
    k = FakeKernel32()
    job = winjob.KillOnCloseJob(k)
    job.add(4321)
    job.close()
    job.close()  # idempotent
    assert k.calls == [
        ("CreateJobObjectW", None, None),
        ("SetInformationJobObject", 100, 9, 0x2000, ctypes.sizeof(winjob.JOBOBJECT_EXTENDED_LIMIT_INFORMATION)),
        ("OpenProcess", 0x0101, False, 4321),  # PROCESS_SET_QUOTA | PROCESS_TERMINATE
        ("AssignProcessToJobObject", 100, 200),
        ("CloseHandle", 200),  # the process handle: only the job's stays open
        ("CloseHandle", 100),  # closing the job kills what is in it
    ]


def test_job_structures_have_the_windows_x64_layout():
    # Flotilla ships 64-bit builds only; these are the sizes 64-bit Windows' headers give.
    assert ctypes.sizeof(ctypes.c_void_p) == 8, "a 64-bit Python is what Flotilla supports"
    assert ctypes.sizeof(winjob.JOBOBJECT_BASIC_LIMIT_INFORMATION) == 64
    assert ctypes.sizeof(winjob.IO_COUNTERS) == 48
    assert ctypes.sizeof(winjob.JOBOBJECT_EXTENDED_LIMIT_INFORMATION) == 144
    assert winjob.JOBOBJECT_BASIC_LIMIT_INFORMATION.LimitFlags.offset == 16


@pytest.mark.parametrize("fail, code, closed", [("CreateJobObjectW", "create", []),
                                                ("SetInformationJobObject", "limit", [100]),
                                                ("OpenProcess", "open", []),
                                                ("AssignProcessToJobObject", "assign", [200])])
def test_job_failures_name_the_step_and_leak_no_handle(fail, code, closed):
    k = FakeKernel32(fail)
    with pytest.raises(winjob.WinJobError) as err:
        winjob.KillOnCloseJob(k).add(4321)
    assert err.value.code == code and f"[job_{code}]" in str(err.value)
    # A job without its kill-on-close limit is never kept; a process handle is always closed.
    assert [c[1] for c in k.calls if c[0] == "CloseHandle"] == closed


def test_a_failed_job_does_not_stop_the_spawn(windows, monkeypatch):
    def broken():
        raise winjob.WinJobError("assign", 5)

    monkeypatch.setattr(winjob, "KillOnCloseJob", broken)
    assert process.kill_with_this_process(4321) is False  # logged; the child's parent watch remains


def test_not_on_windows_there_is_no_job(monkeypatch):
    monkeypatch.setattr(winjob, "KillOnCloseJob", lambda: pytest.fail("a Job object off Windows"))
    assert process.kill_with_this_process(os.getpid()) is False
