"""cgroup-v1 memory groups: run a process under a memory cap and read what it used.

    with MemoryGroup("export", limit_bytes=2 << 30) as group:
        proc = group.popen([sys.executable, "-m", "..."])   # inside the group from its first byte
        with PeakSampler(group) as sampler:
            rc = proc.wait()
        group.stats()          # limit, max_usage, failcnt, oom_kills
        sampler.peaks()        # per process: VmHWM, sampled RssAnon / VmRSS peaks

Why these numbers:
- memory.max_usage_in_bytes is the group's peak as the kernel charged it: anonymous memory
  AND page cache (files read or written, mapped weights). A v1 limit counts both, but page
  cache is reclaimable: a group near its limit drops clean cache before anything is killed,
  so max_usage of a process that streams files sits at the limit by design. The anonymous
  peak of each process says what it really held.
- VmHWM (/proc/PID/status) is the kernel's own peak RSS of a process (anonymous + mapped
  file pages). RssAnon has no kernel peak: PeakSampler samples it (every `interval` s), so
  a spike shorter than that can be missed.
- memory.failcnt counts the times the group hit its limit (cache was reclaimed: not an
  error by itself); oom_kill (memory.oom_control) counts processes the OOM killer ended.

A process joins a group from birth: it is started through `/bin/sh -c 'echo $$ >
cgroup.procs && exec ...'`, so nothing it allocates is charged elsewhere (v1 does not move
earlier charges with a process). Children inherit the group.

cgroup v1's memory controller must be mounted (root only): without it CgroupError says so
with code "cgroup_v1_memory_missing" or "cgroup_not_writable". Nothing falls back silently:
a benchmark or test that asked for a cap must not run uncapped.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

ROOT = Path("/sys/fs/cgroup/memory")  # where cgroup v1 mounts its memory controller
PREFIX = "flotilla-"  # every group we make starts with this (easy to spot, never someone else's)


class CgroupError(RuntimeError):
    """A memory group cannot be made or used; `code` is stable, str(e) is for people."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def require_v1(root: Path = ROOT) -> None:
    """Raise CgroupError unless cgroup-v1 memory groups can be made under root."""
    if not (root / "memory.limit_in_bytes").exists():
        raise CgroupError("cgroup_v1_memory_missing",
                          f"no cgroup-v1 memory controller at {root} (memory.limit_in_bytes missing); "
                          "memory caps need cgroup v1 with the memory controller mounted")
    if not os.access(root, os.W_OK):
        raise CgroupError("cgroup_not_writable", f"cannot create memory groups in {root}: run as root")


@dataclass(frozen=True)
class GroupStats:
    """What the kernel counted for one group."""

    limit_bytes: int  # memory.limit_in_bytes (RSS + page cache)
    usage_bytes: int  # memory.usage_in_bytes now
    max_usage_bytes: int  # memory.max_usage_in_bytes: the peak charged (page cache included)
    failcnt: int  # times the limit was hit (cache reclaimed; not an error alone)
    oom_kills: int  # processes the OOM killer ended in this group
    under_oom: bool  # the group is in OOM right now

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _read_int(path: Path) -> int:
    return int(path.read_text().split()[0])


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def remove_stale_groups(root: Path = ROOT) -> list[Path]:
    """Remove empty groups of ours whose creating process is gone (it was killed before close)."""
    removed = []
    for path in Path(root).glob(f"{PREFIX}*"):
        try:
            pid = int(path.name.rsplit("-", 2)[-2])
        except (IndexError, ValueError):
            continue
        try:
            os.kill(pid, 0)
            continue  # its owner still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            if not (path / "cgroup.procs").read_text().split():
                path.rmdir()
                removed.append(path)
        except OSError:
            pass
    return removed


class MemoryGroup:
    """A fresh cgroup-v1 memory group with a limit; removed on close (context manager)."""

    def __init__(self, name: str, limit_bytes: int, *, root: Path = ROOT) -> None:
        require_v1(root)
        remove_stale_groups(root)
        if limit_bytes <= 0:
            raise CgroupError("bad_limit", f"limit must be > 0 bytes, got {limit_bytes}")
        safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:40]
        self.path = Path(root) / f"{PREFIX}{safe}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.path.mkdir()
        except OSError as e:
            raise CgroupError("cgroup_not_writable", f"cannot create {self.path}: {e}") from None
        self._closed = False
        try:
            self.set_limit(limit_bytes)
        except BaseException:
            self.close()
            raise

    # -- configuration -------------------------------------------------------------------------------
    def set_limit(self, limit_bytes: int) -> None:
        """Set (or change, also while processes run) the cap. With swap, memory+swap gets the same
        cap, so a process cannot escape it into swap."""
        limit = int(limit_bytes)
        memsw = self.path / "memory.memsw.limit_in_bytes"
        current = _read_int(self.path / "memory.limit_in_bytes")
        try:
            # memsw must stay >= the memory limit: raise it first when growing, last when shrinking.
            if memsw.exists() and limit > current:
                _write(memsw, str(limit))
            _write(self.path / "memory.limit_in_bytes", str(limit))
            if memsw.exists() and limit <= current:
                _write(memsw, str(limit))
        except OSError as e:
            raise CgroupError("cgroup_limit_refused",
                              f"cannot set a {limit} byte limit on {self.path}: {e}") from None
        self.limit_bytes = _read_int(self.path / "memory.limit_in_bytes")  # the kernel rounds to pages

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def add(self, pid: int) -> None:
        """Move a running process in (its earlier charges stay where they were)."""
        _write(self.procs_file, str(int(pid)))

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in self.procs_file.read_text().split()]
        except OSError:
            return []

    # -- processes -----------------------------------------------------------------------------------
    def command(self, argv: Sequence[str]) -> list[str]:
        """argv wrapped so the process joins this group before it execs (same pid)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.procs_file), *map(str, argv)]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """subprocess.Popen of argv inside this group from birth."""
        return subprocess.Popen(self.command(argv), **kwargs)

    # -- readings ------------------------------------------------------------------------------------
    def stats(self) -> GroupStats:
        oom = {}
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            oom[key] = int(value or 0)
        return GroupStats(
            limit_bytes=_read_int(self.path / "memory.limit_in_bytes"),
            usage_bytes=_read_int(self.path / "memory.usage_in_bytes"),
            max_usage_bytes=_read_int(self.path / "memory.max_usage_in_bytes"),
            failcnt=_read_int(self.path / "memory.failcnt"),
            oom_kills=oom.get("oom_kill", 0),
            under_oom=bool(oom.get("under_oom", 0)),
        )

    # -- teardown ------------------------------------------------------------------------------------
    def close(self, wait_s: float = 10.0) -> None:
        """Wait for the group's processes to end (SIGKILL them after wait_s: only processes we
        started are in it), then remove the group. Idempotent."""
        if self._closed:
            return
        deadline = time.monotonic() + wait_s
        killed = False
        while self.path.exists():
            pids = self.pids()
            if not pids:
                try:
                    self.path.rmdir()
                    break
                except OSError as e:
                    if e.errno not in (errno.EBUSY, errno.EAGAIN):
                        raise CgroupError("cgroup_remove_failed", f"cannot remove {self.path}: {e}") from None
            elif time.monotonic() > deadline and not killed:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                killed = True
                deadline = time.monotonic() + wait_s
            elif time.monotonic() > deadline:
                raise CgroupError("cgroup_remove_failed", f"{self.path} still holds processes {pids}")
            time.sleep(0.05)
        self._closed = True

    def __enter__(self) -> "MemoryGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------- per-process peaks


def read_status(pid: int) -> dict[str, int] | None:
    """VmHWM, VmRSS, RssAnon, RssFile of a live process, in bytes (None when it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)[:200]


@dataclass
class ProcessPeak:
    """One process's peaks while it was sampled."""

    pid: int
    cmdline: str  # as first seen
    vm_hwm_bytes: int = 0  # the kernel's peak RSS (last value read: it only grows)
    rss_peak_bytes: int = 0  # sampled VmRSS peak
    rss_anon_peak_bytes: int = 0  # sampled RssAnon peak (anonymous: heap, copied weights)
    rss_file_at_anon_peak_bytes: int = 0  # mapped file pages when RssAnon peaked
    samples: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PeakSampler:
    """Samples every process of a group (or given pids) every `interval` s on a thread."""

    group: MemoryGroup | None = None  # sample every pid in this group
    pids: Sequence[int] = ()  # and these
    interval: float = 0.1  # seconds between samples
    _peaks: dict[int, ProcessPeak] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> "PeakSampler":
        self._thread = threading.Thread(target=self._loop, name="flotilla-peak-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.sample()  # one last reading of whoever is still alive

    def __enter__(self) -> "PeakSampler":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        pids = set(self.pids) | set(self.group.pids() if self.group is not None else ())
        for pid in pids:
            st = read_status(pid)
            if not st:
                continue
            peak = self._peaks.get(pid)
            if peak is None:
                peak = self._peaks[pid] = ProcessPeak(pid, _cmdline(pid))
            peak.samples += 1
            peak.vm_hwm_bytes = max(peak.vm_hwm_bytes, st.get("VmHWM", 0))
            peak.rss_peak_bytes = max(peak.rss_peak_bytes, st.get("VmRSS", 0))
            if st.get("RssAnon", 0) > peak.rss_anon_peak_bytes:
                peak.rss_anon_peak_bytes = st["RssAnon"]
                peak.rss_file_at_anon_peak_bytes = st.get("RssFile", 0)

    def peak(self, pid: int) -> ProcessPeak | None:
        return self._peaks.get(pid)

    def peaks(self) -> list[ProcessPeak]:
        return sorted(self._peaks.values(), key=lambda p: -p.vm_hwm_bytes)
