"""Batched O_DIRECT reads through Linux native AIO (io_submit / io_getevents).

Why: a token needs a few thousand bundle reads of 4-16 KiB each. Issued as
one os.preadv per read from a thread pool, every read costs a GIL round trip
and a thread wake-up (tens of microseconds of CPU on a 2-core machine), and
the queue depth is capped by the pool size. Here a whole batch is described
as a numpy array of `struct iocb`s (no per-read Python) and handed to the
kernel in one io_submit; the device sees the full queue depth at once, and
the calling thread reaps completions with io_getevents (ctypes releases the
GIL during both calls).

Single-threaded by design: one Ring is owned by the thread that submits and
reaps (the compute thread). Several batches may be in flight; completions of
other batches met while waiting for one are credited to them.

No liburing/libaio needed: the syscalls are called through libc's syscall().
`available()` says whether this OS/architecture has it (Linux on x86_64 or
aarch64 only: the one Linux-only read path); callers fall back to a thread
pool over the portable reader (engine/platform/pread.py) when not -- and when
FLOTILLA_PORTABLE_IO=1 forces the path Windows and macOS take.
"""

from __future__ import annotations

import ctypes
import os
import platform

import numpy as np

from engine.platform import LINUX, system

_NR = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}  # setup, destroy, getevents, submit
IOCB_CMD_PREAD = 0
IOCB_CMD_PREADV = 7  # buf = address of a struct iovec array, nbytes = its length
IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])

IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<u4"), ("opcode", "<u2"),
                 ("reqprio", "<i2"), ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"),
                 ("offset", "<i8"), ("reserved2", "<u8"), ("flags", "<u4"), ("resfd", "<u4")])
EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
assert IOCB.itemsize == 64 and EVENT.itemsize == 32

_libc = None


def _syscall():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


def available() -> bool:
    return system() == LINUX and platform.machine() in _NR


class AIOError(OSError):
    pass


class Batch:
    """Reads submitted together; `remaining` counts the ones not yet completed."""

    __slots__ = ("tag", "iocbs", "ptrs", "remaining", "failed", "submitted", "keep", "expect")

    def __init__(self, tag: int, iocbs: np.ndarray, keep) -> None:
        self.tag, self.iocbs, self.keep = tag, iocbs, keep  # keep: buffers that must outlive the I/O
        self.ptrs = np.arange(len(iocbs), dtype=np.uint64) * IOCB.itemsize + np.uint64(iocbs.ctypes.data)
        self.remaining = len(iocbs)
        self.submitted = 0
        self.failed: list[tuple[int, int]] = []  # (index, result) of short or failed reads


class Ring:
    """One AIO context with room for `depth` reads in flight."""

    def __init__(self, depth: int = 1024) -> None:
        if not available():
            raise AIOError("Linux native AIO is not available on this platform")
        self.depth = depth
        self._nr = _NR[platform.machine()]
        self._sys = _syscall()
        ctx = ctypes.c_ulong(0)
        if self._sys(self._nr[0], ctypes.c_long(depth), ctypes.byref(ctx)) != 0:
            e = ctypes.get_errno()
            raise AIOError(e, f"io_setup failed: {os.strerror(e)}")
        self._ctx = ctx.value
        self._events = np.zeros(depth, dtype=EVENT)
        self._batches: dict[int, Batch] = {}
        self._next = 1
        self.inflight = 0

    def submit(self, fds: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray, bufs: np.ndarray,
               keep=None, vectored: bool = False, expect: np.ndarray | None = None) -> Batch:
        """Reads i: nbytes[i] bytes at offsets[i] of fds[i] into address bufs[i] (all aligned
        for O_DIRECT). vectored: bufs[i] is the address of an iovec array of nbytes[i]
        entries (scatter read) and expect[i] the bytes it must return. Submits as many
        as the ring has room for; the rest go out while waiting."""
        n = len(offsets)
        iocbs = np.zeros(n, dtype=IOCB)
        tag = self._next
        self._next += 1
        iocbs["data"] = (np.uint64(tag) << np.uint64(32)) | np.arange(n, dtype=np.uint64)
        iocbs["opcode"] = IOCB_CMD_PREADV if vectored else IOCB_CMD_PREAD
        iocbs["fildes"] = fds
        iocbs["buf"] = bufs
        iocbs["nbytes"] = nbytes
        iocbs["offset"] = offsets
        b = Batch(tag, iocbs, keep)
        b.expect = np.asarray(expect if vectored else nbytes, dtype=np.int64)
        self._batches[tag] = b
        self._push(b)
        return b

    def _push(self, b: Batch) -> None:
        while b.submitted < len(b.iocbs) and self.inflight < self.depth:
            k = min(len(b.iocbs) - b.submitted, self.depth - self.inflight)
            ptr = int(b.ptrs.ctypes.data) + 8 * b.submitted
            got = self._sys(self._nr[3], ctypes.c_ulong(self._ctx), ctypes.c_long(k), ctypes.c_void_p(ptr))
            if got < 0:
                e = ctypes.get_errno()
                if e == 11 and self.inflight:  # EAGAIN: the kernel queue is full, reap first
                    return
                raise AIOError(e, f"io_submit failed: {os.strerror(e)}")
            b.submitted += got
            self.inflight += got
            if got == 0:
                return

    def _reap(self, min_nr: int) -> None:
        got = self._sys(self._nr[2], ctypes.c_ulong(self._ctx), ctypes.c_long(min_nr),
                        ctypes.c_long(self.depth), ctypes.c_void_p(self._events.ctypes.data), None)
        if got < 0:
            e = ctypes.get_errno()
            if e == 4:  # EINTR
                return
            raise AIOError(e, f"io_getevents failed: {os.strerror(e)}")
        ev = self._events[:got]
        self.inflight -= got
        tags = (ev["data"] >> np.uint64(32)).astype(np.int64)
        idx = (ev["data"] & np.uint64(0xFFFFFFFF)).astype(np.int64)
        for tag in np.unique(tags).tolist():
            b = self._batches[tag]
            sel = tags == tag
            b.remaining -= int(sel.sum())
            res, want = ev["res"][sel], b.expect[idx[sel]]
            bad = res != want
            if bad.any():
                b.failed += list(zip(idx[sel][bad].tolist(), res[bad].tolist()))
        # batches still waiting for room in the ring go out now
        for other in self._batches.values():
            if other.submitted < len(other.iocbs):
                self._push(other)

    def wait(self, b: Batch) -> None:
        """Block until every read of `b` completed (raises AIOError on a failed read)."""
        while b.remaining:
            if b.submitted < len(b.iocbs):
                self._push(b)
            self._reap(1)
        self._batches.pop(b.tag, None)
        if b.failed:
            i, res = b.failed[0]
            raise AIOError(-res if res < 0 else 5, f"read {i} of a batch returned {res} "
                           f"(wanted {int(b.expect[i])} bytes)")

    def done(self, b: Batch) -> bool:
        if b.remaining and self.inflight:
            self._reap(0)
        return b.remaining == 0

    def close(self) -> None:
        for b in list(self._batches.values()):
            try:
                self.wait(b)
            except OSError:
                pass
        if self._ctx:
            self._sys(self._nr[1], ctypes.c_ulong(self._ctx))
            self._ctx = 0

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def aligned_empty(nbytes: int, align: int = 4096) -> np.ndarray:
    raw = np.empty(nbytes + align, dtype=np.uint8)
    skip = (-raw.ctypes.data) % align
    return raw[skip:skip + nbytes]
