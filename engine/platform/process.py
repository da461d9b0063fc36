"""Child processes, the same way on every OS: started in their own group, stopped
gracefully then killed through psutil, parents watched by pid + creation time.

    proc = spawn(argv, stdout=subprocess.PIPE, die_with_us=True)   # a Popen
    stop(proc, grace=2.0)          # interrupt(), wait, then kill_tree(); its exit code
    stop(proc, 10.0, ask=proc.stdin.close)   # ... asked the caller's way instead
    stop_all(procs, grace=2.0)     # the same with one shared deadline
    interrupt(proc); kill_tree(proc)          # the two halves, for async callers
    ref = ProcessRef.of(pid)       # pid + creation time: a reused pid is another process
    watch(parent_ref(pid), on_gone)   # a daemon thread calls on_gone() once it has exited

Why these mechanisms:
- Own process group: a Ctrl-C in the terminal reaches only the parent, which then stops
  its children in order (POSIX start_new_session; Windows CREATE_NEW_PROCESS_GROUP, which
  is also what lets CTRL_BREAK_EVENT address the child's group).
- Graceful stop: SIGTERM to the group on POSIX; on Windows CTRL_BREAK_EVENT (needs a
  shared console), else psutil terminate(). The hard stop after the grace is psutil's
  kill() of the process and every descendant: no signal numbers (Windows has no SIGKILL).
- Parent watching by pid + creation time: os.getppid() never changes on Windows when the
  parent dies, and a bare pid may be reused by an unrelated process.
- die_with_us (Windows only): a Job object with KILL_ON_JOB_CLOSE (engine/platform/winjob.py)
  ends the children even when this process is killed by TerminateProcess, which runs no
  cleanup at all. POSIX has no such tree-wide guarantee; there the children's own parent
  watch (engine/shards/worker.py) is what ends them, as it also does on Windows.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.platform import WINDOWS, system

log = logging.getLogger(__name__)

GRACE_S = 2.0  # interrupt() -> kill_tree() when the caller does not say
REAP_S = 5.0  # after a kill, wait this long for the exit to be reported
CREATE_NEW_PROCESS_GROUP = 0x00000200  # winbase.h; subprocess only defines it on Windows
BORN_SLACK_S = 1.0  # a "parent" created this much after its child is a reused pid (clock jitter allowed)


# ---------------------------------------------------------------- starting


CREATE_NO_WINDOW = 0x08000000  # winbase.h: a console process without a console window


def group_kwargs() -> dict[str, Any]:
    """Popen keyword arguments that start a child in its own process group on this OS."""
    if system() == WINDOWS:
        return {"creationflags": CREATE_NEW_PROCESS_GROUP}
    return {"start_new_session": True}


def spawn(argv: Sequence[str], *, die_with_us: bool = False, hidden: bool = False,
          **popen: Any) -> subprocess.Popen:
    """subprocess.Popen(argv, **popen) in its own process group (group_kwargs()).
    die_with_us: on Windows the child joins this process's kill-on-close Job object, so it
    ends when we do however we end (see the module docstring); elsewhere a no-op.
    hidden: on Windows CREATE_NO_WINDOW -- a console child of a windowless parent (the tray,
    started as pythonw) gets a console of its own but no window popping up; elsewhere a no-op."""
    kwargs = dict(popen)
    if hidden and system() == WINDOWS:
        kwargs["creationflags"] = kwargs.get("creationflags", 0) | CREATE_NO_WINDOW
    for key, value in group_kwargs().items():
        kwargs[key] = kwargs.get(key, 0) | value if key == "creationflags" else value
    proc = subprocess.Popen(list(argv), **kwargs)
    _group_leaders.add(proc.pid)
    if die_with_us:
        kill_with_this_process(proc)
    return proc


_job: Any = None
_job_lock = threading.Lock()
_group_leaders: set[int] = set()  # pids spawn() started in a group of their own (Windows: CTRL_BREAK targets)


def kill_with_this_process(proc: subprocess.Popen | int) -> bool:
    """Windows: put proc into this process's Job object (KILL_ON_JOB_CLOSE; created on first
    use, its handle closes only when this process exits). True once it is in. Elsewhere
    False: nothing to do. A failure is logged, never raised: the child's parent watch still
    ends it, only later."""
    global _job
    if system() != WINDOWS:
        return False
    from engine.platform import winjob

    try:
        with _job_lock:
            if _job is None:
                _job = winjob.KillOnCloseJob()
            job = _job
        job.add(_pid(proc))
        return True
    except OSError as e:
        log.warning("process %d not tied to this one (Job object): %s", _pid(proc), e)
        return False


# ---------------------------------------------------------------- stopping


def _pid(proc: subprocess.Popen | int) -> int:
    return proc if isinstance(proc, int) else proc.pid


def _ended(proc: subprocess.Popen | int) -> bool:
    """A Popen whose exit was already collected (its pid may belong to another process now)."""
    return not isinstance(proc, int) and proc.returncode is not None


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def interrupt(proc: subprocess.Popen | int) -> None:
    """Ask proc to stop (graceful, returns at once). POSIX: SIGTERM to its group when it
    leads one (spawn()), else to it. Windows: CTRL_BREAK_EVENT to its group when spawn()
    made one (sent to a pid that leads no group, it would reach every process of our console,
    us included), else -- or when it cannot be delivered (no shared console) -- psutil
    terminate()."""
    import signal

    if _ended(proc):
        return
    pid = _pid(proc)
    if system() == WINDOWS:
        if pid in _group_leaders:
            try:
                os.kill(pid, signal.CTRL_BREAK_EVENT)
                return
            except (OSError, AttributeError, ValueError):
                pass
        _psutil_call(pid, "terminate")
        return
    if _leads_group(pid):
        try:
            os.killpg(pid, signal.SIGTERM)  # its own children too
            return
        except OSError:
            pass
    _psutil_call(pid, "terminate")


def kill_tree(proc: subprocess.Popen | int) -> None:
    """Kill proc and every descendant now (psutil kill(): TerminateProcess on Windows).
    POSIX also kills the rest of its group: members whose parent died were re-parented and
    are no longer its descendants."""
    import psutil

    if _ended(proc):
        return
    pid = _pid(proc)
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]  # listed before any dies and re-parents
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        family = []
    leads = system() != WINDOWS and _leads_group(pid)
    for p in family:
        try:
            p.kill()  # psutil checks the creation time first: never a reused pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    if leads:
        import signal

        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass


def _psutil_call(pid: int, method: str) -> None:
    import psutil

    try:
        getattr(psutil.Process(pid), method)()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def stop(proc: subprocess.Popen, grace: float = GRACE_S, *,
         ask: Callable[[], None] | None = None) -> int | None:
    """Stop proc: ask() (default interrupt(proc)), wait up to grace for it to exit, then
    kill_tree(proc). Its exit code, or None if even the kill was not reported within REAP_S."""
    return stop_all([proc], grace, ask=None if ask is None else {proc: ask})[0]


def stop_all(procs: Iterable[subprocess.Popen], grace: float = GRACE_S, *,
             ask: dict[subprocess.Popen, Callable[[], None]] | None = None) -> list[int | None]:
    """stop() for several processes with one deadline: every one is asked at once, the
    ones still running at the deadline are killed. Exit codes in the order given."""
    procs = list(procs)
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        try:
            (ask or {}).get(p, lambda p=p: interrupt(p))()
        except Exception as e:  # a broken request must not save it from the kill
            log.debug("asking pid %d to stop failed: %s", p.pid, e)
    deadline = time.monotonic() + grace
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.info("pid %d still running %.1f s after it was asked to stop: killing it", p.pid, grace)
            kill_tree(p)
            try:
                p.wait(REAP_S)
            except subprocess.TimeoutExpired:
                log.warning("pid %d did not exit after a kill", p.pid)
    return [p.returncode for p in procs]


# ---------------------------------------------------------------- watching


@dataclass(frozen=True)
class ProcessRef:
    """One process, told apart from any later one that gets its pid."""

    pid: int  # the process id; the OS may give it to another process once this one is gone
    created: float  # its creation time (psutil create_time(), seconds since the epoch)

    @classmethod
    def of(cls, pid: int) -> ProcessRef | None:
        """The running process with this pid now; None if there is none (or only a zombie)."""
        import psutil

        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                return None
            return cls(pid, p.create_time())
        except psutil.NoSuchProcess:
            return None
        except psutil.AccessDenied:  # exists, but we may not look: alive, creation unknown
            return cls(pid, 0.0)

    def alive(self) -> bool:
        """Still running: the pid exists, is not a zombie (exited, not yet reaped by its
        parent) and was created when this process was (not reused since)."""
        import psutil

        try:
            p = psutil.Process(self.pid)
            if self.created and abs(p.create_time() - self.created) > 1e-3:
                return False
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return True  # it exists; we cannot tell more, and a wrong "gone" would end a healthy child


def parent_ref(pid: int) -> ProcessRef | None:
    """pid as the parent of this process: None if it is gone or is a younger process that
    reused the pid (a parent is always created before its child)."""
    ref = ProcessRef.of(pid)
    me = ProcessRef.of(os.getpid())
    if ref is None or (me is not None and ref.created and me.created and ref.created > me.created + BORN_SLACK_S):
        return None
    return ref


def watch(ref: ProcessRef | None, on_gone: Callable[[], None], interval: float = 0.5,
          name: str = "process-watch") -> threading.Thread:
    """A daemon thread that calls on_gone() once ref is no longer alive (at once for None)."""
    def run() -> None:
        while ref is not None and ref.alive():
            time.sleep(interval)
        on_gone()

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t
