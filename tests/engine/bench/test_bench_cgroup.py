"""cgroup-v1 memory groups (engine/bench/_cgroup.py), for real: children under and over a cap.

These need root and the cgroup-v1 memory controller, as CI has; without them the tests fail
with CgroupError instead of skipping (a cap that silently does nothing proves nothing).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from engine.bench._cgroup import CgroupError, MemoryGroup, PeakSampler, require_v1

MB = 1 << 20


def _alloc(mb: int, hold_s: float = 0.0) -> list[str]:
    """A child that allocates and touches mb MiB (bytearray zero-fills every page)."""
    return [sys.executable, "-c", f"import time; b = bytearray({mb} << 20); time.sleep({hold_s}); print('done')"]


def test_a_child_allocating_past_its_cap_is_oom_killed():
    with MemoryGroup("test-over", 64 * MB) as g:
        proc = g.popen(_alloc(256), stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=60)
        stats = g.stats()
    assert proc.returncode == -9 and "done" not in out
    assert stats.oom_kills >= 1
    assert stats.max_usage_bytes >= 0.9 * stats.limit_bytes  # it reached the cap, never beyond
    assert stats.max_usage_bytes <= stats.limit_bytes


def test_a_child_under_its_cap_runs_to_the_end():
    with MemoryGroup("test-under", 256 * MB) as g:
        proc = g.popen(_alloc(32), stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=60)
        stats = g.stats()
    assert proc.returncode == 0 and "done" in out
    assert stats.oom_kills == 0
    assert stats.max_usage_bytes >= 32 * MB  # its allocation was charged here: it joined at birth


def test_the_child_is_in_the_group_from_birth_with_its_own_pid():
    with MemoryGroup("test-birth", 128 * MB) as g:
        proc = g.popen([sys.executable, "-c", "import os; print(os.getpid()); print(open('/proc/self/cgroup').read())"],
                       stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=30)
        name = g.path.name
    pid, rest = out.split("\n", 1)
    assert int(pid) == proc.pid  # the shell exec'd it: the pid we hold is the program's
    assert any("memory" in line and line.endswith(name) for line in rest.splitlines()), rest


def test_the_sampler_sees_a_process_peak_after_it_freed_the_memory():
    with MemoryGroup("test-sampler", 512 * MB) as g:
        code = "import time; b = bytearray(120 << 20); time.sleep(0.6); del b; time.sleep(0.6)"
        proc = g.popen([sys.executable, "-c", code])
        with PeakSampler(g, pids=[proc.pid], interval=0.05) as sampler:
            proc.wait(30)
    peak = sampler.peak(proc.pid)
    assert peak is not None and peak.samples >= 3
    assert peak.rss_anon_peak_bytes >= 120 * MB  # sampled while it was held
    assert peak.vm_hwm_bytes >= 120 * MB  # the kernel's own peak


def test_close_removes_the_group_and_ends_what_is_left_in_it():
    g = MemoryGroup("test-close", 64 * MB)
    proc = g.popen(["sleep", "60"])
    time.sleep(0.2)
    t0 = time.monotonic()
    g.close(wait_s=0.3)
    assert not g.path.exists()
    assert proc.wait(5) == -9 and time.monotonic() - t0 < 5
    g.close()  # idempotent


def test_the_limit_can_change_while_a_process_runs():
    with MemoryGroup("test-limit", 64 * MB) as g:
        proc = g.popen(_alloc(128, hold_s=0.2), stdout=subprocess.PIPE, text=True)
        g.set_limit(512 * MB)  # before it allocates (python starts in > 10 ms)
        out, _ = proc.communicate(timeout=60)
        assert g.stats().limit_bytes == 512 * MB
    assert proc.returncode == 0 and "done" in out


def test_without_cgroup_v1_memory_it_fails_loudly(tmp_path):
    with pytest.raises(CgroupError) as e:
        require_v1(tmp_path)
    assert e.value.code == "cgroup_v1_memory_missing" and str(tmp_path) in str(e.value)
    with pytest.raises(CgroupError):
        MemoryGroup("x", 64 * MB, root=tmp_path)


def test_groups_left_by_a_killed_owner_are_removed_by_the_next_one():
    from engine.bench._cgroup import PREFIX, ROOT

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = ROOT / f"{PREFIX}left-{dead.pid}-deadbeef"
    stale.mkdir()
    try:
        with MemoryGroup("test-next", 64 * MB) as g:
            assert g.path.exists()
        assert not stale.exists()
    finally:
        if stale.exists():
            stale.rmdir()
