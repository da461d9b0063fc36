"""How much more RAM this process may take: the smaller of the PC's available memory and
what is left under its memory cgroup's limit (Linux containers, `systemd-run -p MemoryMax`,
the benchmarks' capped runs). Elsewhere (Windows, macOS) the cgroup part is simply absent.

Page cache counts against a cgroup's limit; its clean, unmapped file pages are reclaimed
before the limit bites (a file just written and read back sits on the *active* list, so
counting inactive pages alone would see no room after building a store), so they count
as room: file - mapped - dirty - writeback.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # v1 reports "no limit" as a huge page-rounded number


def available_ram() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def cgroup_room(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> int | None:
    """Bytes left under this process's memory cgroup limit (v1 or v2), None without one."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _id, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.lstrip("/")
        if "memory" in controllers.split(","):  # v1
            return _room(root / "memory" / rel, "memory.limit_in_bytes", "memory.usage_in_bytes", _V1_KEYS)
        if _id == "0" and controllers == "" and (root / rel / "memory.max").exists():  # v2
            return _room(root / rel, "memory.max", "memory.current", _V2_KEYS)
    return None


# memory.stat keys: (page cache, of it mapped, dirty, under writeback)
_V1_KEYS = ("total_cache", "total_mapped_file", "total_dirty", "total_writeback")
_V2_KEYS = ("file", "file_mapped", "file_dirty", "file_writeback")


def _room(folder: Path, limit_file: str, usage_file: str, keys: tuple[str, str, str, str]) -> int | None:
    try:
        raw = (folder / limit_file).read_text().strip()
        if raw == "max" or int(raw) >= _UNLIMITED:
            return None
        limit, usage = int(raw), int((folder / usage_file).read_text().strip())
        stat = {}
        for line in (folder / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            stat[key] = int(value or 0)
    except (OSError, ValueError):
        return None
    cache, mapped, dirty, writeback = (stat.get(k, 0) for k in keys)
    return max(0, limit - usage + max(0, cache - mapped - dirty - writeback))


def memory_room() -> int:
    """Bytes this process may still take without swapping or being OOM-killed."""
    room = cgroup_room()
    free = available_ram()
    return free if room is None else min(free, room)


def release_free_heap() -> None:
    """Give freed heap memory back to the OS now (glibc's malloc_trim): after a one-off phase
    that allocated and freed a lot (building a store, calibrating), so the memory left for
    caches is measured without it. A no-op where there is no glibc (Windows, macOS, musl)."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def settle_heap() -> None:
    """After an engine has loaded, before a long-lived process serves with it: collect the
    garbage there is now, then move every object alive out of the cyclic GC's reach.

    With torch, transformers and OpenVINO loaded the heap holds millions of long-lived
    objects, and one full (generation 2) collection walks them all: 150-480 ms (the app,
    measured), holding the GIL, so every answer in flight stalls for it. Frozen
    (gc.freeze, the CPython way for exactly this), later collections walk only what was
    allocated since. What an earlier call froze is unfrozen and collected first, so an
    engine closed since then does not stay in memory for good."""
    import gc

    gc.unfreeze()
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def settled_heap():
    """settle_heap() for one measured run of an engine opened in this process (a benchmark
    measures what `flotilla chat`, `serve` and the app run: a settled heap). On the way out
    the heap is unfrozen, so the run's engine, closed by then, can be collected."""
    import gc

    settle_heap()
    try:
        yield
    finally:
        gc.unfreeze()
