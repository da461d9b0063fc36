"""Positional reads into caller buffers, the same on every OS, with the page cache
bypassed where the OS can.

How a read at an offset happens (`Reader.method`), one portable mechanism first:

    "preadv"  os.preadv straight into the caller's buffers: no lock, no copy
              (Linux, the BSDs, macOS 11+)
    "pread"   os.pread and a copy into the buffer (a POSIX without preadv)
    "seek"    a per-handle lock around seek + readinto, straight into the buffer
              (Windows, which has neither call). FLOTILLA_PORTABLE_IO=1 forces it on
              every OS -- read when a reader opens, i.e. when a store opens -- so this
              Linux suite runs the very path Windows takes.

Every method resumes short reads and raises ShortReadError (code "short_read") when
the file ends before the buffers are full.

How the file is opened (`Reader.io_mode`), the one OS branch (`_open_unbuffered`):

    "o_direct"      Linux: O_DIRECT, checked to have stuck (F_GETFL)
    "no_buffering"  Windows: CreateFileW(FILE_FLAG_NO_BUFFERING), made an fd by
                    msvcrt.open_osfhandle (both imported on Windows only)
    "f_nocache"     macOS: fcntl(F_NOCACHE, 1). Advisory: pages already cached may
                    still be served from RAM
    "buffered"      not asked for, or the OS / file system refused; then
                    `fallback_reason` says why and `fallback_code` is one of
                    FALLBACK_CODES

O_DIRECT and FILE_FLAG_NO_BUFFERING both want offsets, sizes and buffer addresses
aligned to the device sector: ALIGN (4 KiB) covers 512-byte and 4K-native disks, and
callers keep to it. An unbuffered open is followed by one aligned probe read, so a
file system that opens that way but cannot read so falls back at open, not at the
first real read.
"""

from __future__ import annotations

import io
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from engine.platform import MACOS, WINDOWS, system

ALIGN = 4096  # offsets, sizes and buffer addresses of unbuffered reads
PORTABLE_ENV = "FLOTILLA_PORTABLE_IO"  # "1": the "seek" method on every OS (tests the Windows path)
METHODS = ("preadv", "pread", "seek")
IO_MODES = ("o_direct", "no_buffering", "f_nocache", "buffered")
UNBUFFERED = {"linux": "o_direct", WINDOWS: "no_buffering", MACOS: "f_nocache"}  # system() -> mode
LABELS = {"o_direct": "O_DIRECT", "no_buffering": "FILE_FLAG_NO_BUFFERING", "f_nocache": "F_NOCACHE"}
FALLBACK_CODES = ("unsupported", "refused", "probe_failed", "ram")  # "ram": set by engine/moe/store.py (tmpfs)
IOV_MAX = 1024  # iovecs per preadv call (Linux's limit; others are not lower)
CHUNK = 1 << 30  # bytes per readinto: Windows' C runtime caps one read at INT_MAX, which is not aligned

# Windows (winnt.h / fileapi.h)
GENERIC_READ = 0x80000000
FILE_SHARE_READ, FILE_SHARE_WRITE, FILE_SHARE_DELETE = 0x1, 0x2, 0x4
OPEN_EXISTING = 3
FILE_ATTRIBUTE_NORMAL = 0x80
FILE_FLAG_NO_BUFFERING = 0x20000000
O_BINARY = getattr(os, "O_BINARY", 0x8000)  # no CR/LF translation by the C runtime
F_NOCACHE = 48  # macOS <sys/fcntl.h>; fcntl.F_NOCACHE where Python exposes it


class ShortReadError(OSError):
    """The file ended before the buffers were full (a truncated or damaged file)."""

    code = "short_read"

    def __init__(self, path: Path | str, offset: int, want: int, got: int) -> None:
        super().__init__(5, f"short read of {path} at offset {offset}: {got} of {want} bytes")  # EIO
        self.offset, self.want, self.got = offset, want, got


def portable_forced() -> bool:
    """FLOTILLA_PORTABLE_IO set to 1/true/yes/on."""
    return os.environ.get(PORTABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def unbuffered_mode() -> str:
    """The mode an unbuffered open asks for on this OS ("o_direct", "no_buffering", "f_nocache")."""
    return UNBUFFERED[system()]


def choose_method(portable: bool) -> str:
    if portable or system() == WINDOWS:
        return "seek"
    if hasattr(os, "preadv"):
        return "preadv"
    if hasattr(os, "pread"):
        return "pread"
    return "seek"


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned zeroed memory (an anonymous mmap on every OS), valid for unbuffered reads."""
    return mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN))


def _bytes_views(bufs: Iterable[Any]) -> list[memoryview]:
    views = []
    for b in bufs:
        v = memoryview(b)
        views.append(v if v.format == "B" and v.ndim == 1 else v.cast("B"))
    return [v for v in views if v.nbytes]


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """The views still to fill after `n` more bytes landed (a short read resumes here)."""
    while views and n >= views[0].nbytes:
        n -= views[0].nbytes
        views = views[1:]
    if n:
        views = [views[0][n:]] + views[1:]
    return views


_FileIO = io.FileIO  # the raw file of the "seek" method (a seam for tests: short reads)


class Reader:
    """One open file read at offsets into caller buffers; safe to share between threads."""

    def __init__(self, fd: int, path: Path | str, io_mode: str, method: str,
                 fallback_reason: str | None = None, fallback_code: str | None = None) -> None:
        self.fd = fd  # an OS file descriptor (a C-runtime one on Windows)
        self.path = Path(path)
        self.io_mode = io_mode  # what reads really go through: one of IO_MODES
        self.method = method  # how: one of METHODS
        self.fallback_reason = fallback_reason  # why an unbuffered open fell back (None if it did not)
        self.fallback_code = fallback_code  # the same as a tag: one of FALLBACK_CODES, or None
        self._lock = threading.Lock()  # "seek": one file position per handle
        self._file = _FileIO(fd, "rb", closefd=False) if method == "seek" else None

    def readinto(self, buf: Any, offset: int) -> int:
        """Fill `buf` (any writable buffer) with the bytes at `offset`; returns its size."""
        return self.readv_into([buf], offset)

    def readv_into(self, bufs: Iterable[Any], offset: int) -> int:
        """Fill `bufs` in turn with the bytes from `offset` on (a scatter read); returns
        the bytes read. Raises ShortReadError at end of file, OSError on a failed read."""
        views = _bytes_views(bufs)
        want = sum(v.nbytes for v in views)
        if self.method == "preadv":
            got = self._preadv(views, offset)
        elif self.method == "pread":
            got = self._pread(views, offset)
        else:
            got = self._seek_read(views, offset)
        if got != want:
            raise ShortReadError(self.path, offset, want, got)
        return got

    def _preadv(self, views: list[memoryview], offset: int) -> int:
        got = 0
        while views:
            r = os.preadv(self.fd, views[:IOV_MAX], offset + got)
            if r <= 0:
                break
            got += r
            views = _advance(views, r)
        return got

    def _pread(self, views: list[memoryview], offset: int) -> int:
        got = 0
        for v in views:
            while v.nbytes:
                data = os.pread(self.fd, v.nbytes, offset + got)
                if not data:
                    return got
                v[:len(data)] = data
                got += len(data)
                v = v[len(data):]
        return got

    def _seek_read(self, views: list[memoryview], offset: int) -> int:
        got = 0
        with self._lock:  # the position is shared by every thread reading this handle
            self._file.seek(offset)
            for v in views:
                while v.nbytes:
                    r = self._file.readinto(v[:CHUNK])  # resumes where a short read stopped
                    if not r:
                        return got
                    got += r
                    v = v[r:]
        return got

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        if self.fd >= 0:
            if self._file is not None:
                self._file.close()  # closefd=False: only the wrapper
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_reader(path: Path | str, unbuffered: bool = True, portable: bool | None = None) -> Reader:
    """Open `path` for positional reads: unbuffered (this OS's way) when asked and really
    in effect, else buffered with the reason. portable None: FLOTILLA_PORTABLE_IO decides."""
    method = choose_method(portable_forced() if portable is None else portable)
    if not unbuffered:
        return Reader(_open_buffered(path), path, "buffered", method)
    fd, mode, code, reason = _open_unbuffered(path)
    if fd is not None:
        reader = Reader(fd, path, mode, method)
        try:
            if reader.size() >= ALIGN:  # file systems that open unbuffered but cannot read so fail here
                reader.readinto(aligned_buffer(ALIGN), 0)
            return reader
        except OSError as e:
            reader.close()
            code, reason = "probe_failed", f"an {LABELS[mode]} read fails ({e.strerror or e})"
    return Reader(_open_buffered(path), path, "buffered", method, reason, code)


def _open_buffered(path: Path | str) -> int:
    return os.open(path, (os.O_RDONLY | O_BINARY) if system() == WINDOWS else os.O_RDONLY)


def _open_unbuffered(path: Path | str) -> tuple[int | None, str, str | None, str | None]:
    """(fd or None, mode, fallback code, fallback reason): the OS branch."""
    sysname = system()
    if sysname == WINDOWS:
        return _open_no_buffering(path)
    if sysname == MACOS:
        return _open_f_nocache(path)
    return _open_o_direct(path)


def _open_o_direct(path: Path | str) -> tuple[int | None, str, str | None, str | None]:
    mode = "o_direct"
    if not hasattr(os, "O_DIRECT"):
        return None, mode, "unsupported", "O_DIRECT is not available on this platform"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        return None, mode, "refused", f"the file system refuses O_DIRECT ({e.strerror or e})"
    import fcntl  # POSIX only, as O_DIRECT is

    if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
        os.close(fd)
        return None, mode, "probe_failed", "an O_DIRECT read fails (the O_DIRECT flag did not stick)"
    return fd, mode, None, None


def _fcntl():
    import fcntl  # POSIX only; a seam so tests fake macOS' F_NOCACHE on Linux

    return fcntl


def _open_f_nocache(path: Path | str) -> tuple[int | None, str, str | None, str | None]:
    mode = "f_nocache"
    fd = os.open(path, os.O_RDONLY)
    fcntl = _fcntl()
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", F_NOCACHE), 1)
    except OSError as e:
        os.close(fd)
        return None, mode, "refused", f"the file system refuses F_NOCACHE ({e.strerror or e})"
    return fd, mode, None, None


@dataclass(frozen=True)
class WindowsAPI:
    kernel32: Any  # CreateFileW, CloseHandle (ctypes.WinDLL, use_last_error)
    msvcrt: Any  # open_osfhandle: a HANDLE -> a C-runtime fd that os and io accept
    last_error: Callable[[], int]  # ctypes.get_last_error
    invalid_handle: int  # INVALID_HANDLE_VALUE as CreateFileW's HANDLE restype returns it


def _windows_api() -> WindowsAPI:
    """Windows only (imports ctypes' Windows half and msvcrt); a seam so tests fake it."""
    import ctypes
    import msvcrt
    from ctypes import wintypes

    k32 = ctypes.WinDLL("kernel32", use_last_error=True)
    k32.CreateFileW.restype = wintypes.HANDLE
    k32.CreateFileW.argtypes = (wintypes.LPCWSTR, wintypes.DWORD, wintypes.DWORD, wintypes.LPVOID,
                                wintypes.DWORD, wintypes.DWORD, wintypes.HANDLE)
    k32.CloseHandle.argtypes = (wintypes.HANDLE,)
    return WindowsAPI(k32, msvcrt, ctypes.get_last_error, ctypes.c_void_p(-1).value)


def _open_no_buffering(path: Path | str) -> tuple[int | None, str, str | None, str | None]:
    mode = "no_buffering"
    api = _windows_api()
    handle = api.kernel32.CreateFileW(str(path), GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE,
                                      None, OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL | FILE_FLAG_NO_BUFFERING, None)
    if handle is None or handle == api.invalid_handle:
        return None, mode, "refused", f"the file system refuses FILE_FLAG_NO_BUFFERING (Windows error {api.last_error()})"
    try:
        fd = api.msvcrt.open_osfhandle(handle, os.O_RDONLY | O_BINARY)  # the fd owns the handle from here on
    except OSError as e:
        api.kernel32.CloseHandle(handle)
        return None, mode, "refused", f"FILE_FLAG_NO_BUFFERING handle not usable as a file ({e.strerror or e})"
    return fd, mode, None, None


__all__ = ["ALIGN", "FALLBACK_CODES", "IO_MODES", "METHODS", "PORTABLE_ENV", "Reader", "ShortReadError",
           "aligned_buffer", "choose_method", "open_reader", "portable_forced", "unbuffered_mode"]
