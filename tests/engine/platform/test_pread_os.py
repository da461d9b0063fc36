"""The OS branch of the portable reader with the OS faked: Windows opens through
CreateFileW(FILE_FLAG_NO_BUFFERING) + msvcrt.open_osfhandle and reads with the
"seek" method; macOS sets F_NOCACHE; a refusal falls back to buffered reads."""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest

from engine.platform import pread

REPO_SCRATCH = Path(__file__).resolve().parents[3] / ".cache"  # the repository's disk: O_DIRECT works


@pytest.fixture()
def disk_file():
    REPO_SCRATCH.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="test-pread-os-", dir=REPO_SCRATCH))
    data = np.random.default_rng(3).integers(0, 256, 64 * 4096, dtype=np.uint8).tobytes()
    (d / "blob.bin").write_bytes(data)
    yield d / "blob.bin", data
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


class FakeFunction:
    """A ctypes foreign function: restype/argtypes settable, calls recorded."""

    def __init__(self, log: list, name: str, result) -> None:
        self.log, self.name, self.result = log, name, result
        self.restype = self.argtypes = None

    def __call__(self, *args):
        self.log.append((self.name, args))
        return self.result(*args) if callable(self.result) else self.result


def fake_windows(monkeypatch, path: Path, create_result=0x1234, osfhandle_error: OSError | None = None) -> list:
    """sys.platform = win32, with kernel32 (ctypes.WinDLL) and msvcrt faked. The fake
    open_osfhandle returns a real O_DIRECT fd of `path`: reads then keep the alignment
    rules FILE_FLAG_NO_BUFFERING has. Returns the log of OS calls."""
    log: list = []
    k32 = types.SimpleNamespace(CreateFileW=FakeFunction(log, "CreateFileW", create_result),
                                CloseHandle=FakeFunction(log, "CloseHandle", 1))

    def open_osfhandle(handle, flags):
        log.append(("open_osfhandle", (handle, flags)))
        if osfhandle_error:
            raise osfhandle_error
        return os.open(path, os.O_RDONLY | os.O_DIRECT)

    def win_dll(name, use_last_error=False):
        log.append(("WinDLL", (name, use_last_error)))
        return k32

    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(ctypes, "WinDLL", win_dll, raising=False)
    monkeypatch.setattr(ctypes, "get_last_error", lambda: 5, raising=False)  # ERROR_ACCESS_DENIED
    monkeypatch.setitem(sys.modules, "msvcrt", types.SimpleNamespace(open_osfhandle=open_osfhandle))
    return log


def test_windows_opens_with_no_buffering_and_reads_by_seek(disk_file, monkeypatch):
    path, data = disk_file
    log = fake_windows(monkeypatch, path)
    with pread.open_reader(path) as r:
        assert (r.io_mode, r.method, r.fallback_reason) == ("no_buffering", "seek", None)
        assert pread.unbuffered_mode() == "no_buffering"
        buf = pread.aligned_buffer(3 * 4096)
        r.readinto(buf, 5 * 4096)
        assert bytes(buf) == data[5 * 4096:8 * 4096]
    names = [c[0] for c in log]
    assert names == ["WinDLL", "CreateFileW", "open_osfhandle"]  # the handle is owned by the fd: no CloseHandle
    assert log[0][1] == ("kernel32", True)
    args = log[1][1]
    assert args[0] == str(path)
    assert args[1] == pread.GENERIC_READ and args[4] == pread.OPEN_EXISTING
    assert args[2] & pread.FILE_SHARE_READ  # other readers (and the model converter) may open it too
    assert args[5] & pread.FILE_FLAG_NO_BUFFERING
    assert log[2][1] == (0x1234, os.O_RDONLY | pread.O_BINARY)


def test_windows_refusal_falls_back_to_buffered_reads(disk_file, monkeypatch):
    path, data = disk_file
    log = fake_windows(monkeypatch, path, create_result=ctypes.c_void_p(-1).value)  # INVALID_HANDLE_VALUE
    with pread.open_reader(path) as r:
        assert (r.io_mode, r.method, r.fallback_code) == ("buffered", "seek", "refused")
        assert "FILE_FLAG_NO_BUFFERING" in r.fallback_reason and "error 5" in r.fallback_reason
        buf = bytearray(10)
        r.readinto(buf, 7)  # buffered: any offset and size
        assert bytes(buf) == data[7:17]
    assert [c[0] for c in log] == ["WinDLL", "CreateFileW"]


def test_windows_handle_closed_when_it_cannot_become_an_fd(disk_file, monkeypatch):
    path, _ = disk_file
    log = fake_windows(monkeypatch, path, osfhandle_error=OSError(24, "Too many open files"))
    with pread.open_reader(path) as r:
        assert r.io_mode == "buffered" and r.fallback_code == "refused"
    assert [c[0] for c in log] == ["WinDLL", "CreateFileW", "open_osfhandle", "CloseHandle"]
    assert log[-1][1] == (0x1234,)


def test_macos_sets_f_nocache(disk_file, monkeypatch):
    path, data = disk_file
    calls = []
    fake = types.SimpleNamespace(fcntl=lambda fd, cmd, arg: calls.append((cmd, arg)) or 0)
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(pread, "_fcntl", lambda: fake)
    with pread.open_reader(path) as r:
        assert (r.io_mode, r.method, r.fallback_reason) == ("f_nocache", "preadv", None)
        buf = bytearray(100)  # F_NOCACHE has no alignment rule
        r.readinto(buf, 3)
        assert bytes(buf) == data[3:103]
    assert calls == [(pread.F_NOCACHE, 1)]


def test_macos_refusal_falls_back_to_buffered_reads(disk_file, monkeypatch):
    path, _ = disk_file

    def refuse(fd, cmd, arg):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(pread, "_fcntl", lambda: types.SimpleNamespace(fcntl=refuse))
    with pread.open_reader(path) as r:
        assert r.io_mode == "buffered" and r.fallback_code == "refused"
        assert "F_NOCACHE" in r.fallback_reason


def test_unbuffered_open_whose_probe_read_fails_falls_back(disk_file, monkeypatch):
    """A file system that opens unbuffered but cannot read so is caught at open."""
    path, data = disk_file
    real = pread.Reader.readv_into
    state = {"probed": False}

    def failing_probe(self, bufs, offset):
        if self.io_mode != "buffered" and not state["probed"]:
            state["probed"] = True
            raise OSError(22, "Invalid argument")
        return real(self, bufs, offset)

    monkeypatch.setattr(pread.Reader, "readv_into", failing_probe)
    with pread.open_reader(path) as r:
        assert r.io_mode == "buffered" and r.fallback_code == "probe_failed"
        assert "an O_DIRECT read fails" in r.fallback_reason and "Invalid argument" in r.fallback_reason
        buf = bytearray(5)
        r.readinto(buf, 1)
        assert bytes(buf) == data[1:6]
