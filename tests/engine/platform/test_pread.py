"""The portable positional reader: every read method returns the file's bytes at any
offset (short reads resumed, end of file reported), from many threads on one handle,
unbuffered on this disk; FLOTILLA_PORTABLE_IO picks the Windows method here."""

from __future__ import annotations

import io
import os
import random
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from engine.platform import pread

REPO_SCRATCH = Path(__file__).resolve().parents[3] / ".cache"  # the repository's disk (ext4 here), not tmpfs
SIZE = 64 * 1024 + 123  # not a multiple of anything: the tail is unaligned


@pytest.fixture()
def data_file(tmp_path) -> tuple[Path, bytes]:
    data = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    f = tmp_path / "blob.bin"
    f.write_bytes(data)
    return f, data


@pytest.fixture()
def disk_file():
    """A 1 MiB file on the repository's disk, where O_DIRECT is in effect."""
    REPO_SCRATCH.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="test-pread-", dir=REPO_SCRATCH))
    data = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    (d / "blob.bin").write_bytes(data)
    yield d / "blob.bin", data
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def _open(path: Path, method: str, monkeypatch, unbuffered: bool = False) -> pread.Reader:
    """A reader using `method`: "seek" through the portable setting, "pread" as on a POSIX without preadv."""
    if method == "pread":
        monkeypatch.delattr(os, "preadv")
    r = pread.open_reader(path, unbuffered=unbuffered, portable=method == "seek")
    assert r.method == method
    return r


@pytest.mark.parametrize("method", pread.METHODS)
def test_reads_at_any_offset_and_size_into_caller_buffers(data_file, method, monkeypatch):
    path, data = data_file
    with _open(path, method, monkeypatch) as r:
        assert r.io_mode == "buffered" and r.fallback_reason is None
        for offset, n in [(0, 1), (1, 4095), (4095, 4097), (12345, 20000), (SIZE - 7, 7), (0, SIZE)]:
            buf = bytearray(n)
            assert r.readinto(buf, offset) == n
            assert bytes(buf) == data[offset:offset + n]
        arr = np.zeros((3, 5), dtype=np.float32)  # a numpy array is filled as its raw bytes
        r.readinto(arr, 100)
        assert arr.tobytes() == data[100:160]
        big = bytearray(9000)  # an unaligned slice of a buffer: its address is odd
        view = memoryview(big)[3:3 + 5000]
        r.readinto(view, 777)
        assert bytes(view) == data[777:5777] and big[:3] == b"\0\0\0"


@pytest.mark.parametrize("method", pread.METHODS)
def test_scatter_read_fills_buffers_in_turn(data_file, method, monkeypatch):
    path, data = data_file
    with _open(path, method, monkeypatch) as r:
        bufs = [bytearray(10), bytearray(0), bytearray(4096), bytearray(3)]
        assert r.readv_into(bufs, 50) == 4109
        assert b"".join(bytes(b) for b in bufs) == data[50:50 + 4109]


@pytest.mark.parametrize("method", pread.METHODS)
def test_end_of_file_is_a_short_read_error(data_file, method, monkeypatch):
    path, data = data_file
    with _open(path, method, monkeypatch) as r:
        buf = bytearray(100)
        with pytest.raises(pread.ShortReadError) as e:
            r.readinto(buf, SIZE - 40)
        assert e.value.code == "short_read" and (e.value.want, e.value.got) == (100, 40)
        assert isinstance(e.value, OSError) and bytes(buf[:40]) == data[-40:]


def _trickle_preadv(real):
    def preadv(fd, views, offset):  # the kernel may return fewer bytes than asked: 1000 at most here
        left, cut = 1000, []
        for v in views:
            if left <= 0:
                break
            cut.append(memoryview(v)[:left])
            left -= len(cut[-1])
        return real(fd, cut, offset)
    return preadv


def _trickle_pread(real):
    return lambda fd, n, offset: real(fd, min(n, 1000), offset)


class TrickleFileIO(io.FileIO):
    def readinto(self, b):
        return super().readinto(memoryview(b)[:1000])


@pytest.mark.parametrize("method", pread.METHODS)
def test_short_reads_are_resumed(data_file, method, monkeypatch):
    path, data = data_file
    if method == "preadv":
        monkeypatch.setattr(os, "preadv", _trickle_preadv(os.preadv))
    elif method == "pread":
        monkeypatch.setattr(os, "pread", _trickle_pread(os.pread))
    else:
        monkeypatch.setattr(pread, "_FileIO", TrickleFileIO)
    with _open(path, method, monkeypatch) as r:
        bufs = [bytearray(2500), bytearray(1), bytearray(7000)]  # resumes cross buffer boundaries
        assert r.readv_into(bufs, 333) == 9501
        assert b"".join(bytes(b) for b in bufs) == data[333:333 + 9501]


@pytest.fixture()
def fast_switching():
    """Threads switch every microsecond, so a race between one thread's seek and
    another's read shows up in a few hundred reads (it does without the lock)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


@pytest.mark.parametrize("method", pread.METHODS)
def test_concurrent_reads_on_one_handle(data_file, method, monkeypatch, fast_switching):
    """8 threads read random ranges through one reader: each gets its own bytes (the
    "seek" method's lock keeps one thread's seek from moving another's read)."""
    path, data = data_file
    with _open(path, method, monkeypatch) as r:
        errors: list[str] = []

        def worker(seed: int) -> None:
            rnd = random.Random(seed)
            for _ in range(300):
                offset = rnd.randrange(SIZE - 1)
                n = rnd.randrange(1, min(6000, SIZE - offset) + 1)
                buf = bytearray(n)
                try:
                    r.readinto(buf, offset)
                except OSError as e:  # a thread's exception would otherwise only be a warning
                    errors.append(f"{offset}+{n}: {e}")
                    continue
                if bytes(buf) != data[offset:offset + n]:
                    errors.append(f"{offset}+{n}")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors


@pytest.mark.parametrize("portable", [False, True])
def test_unbuffered_reads_on_this_disk(disk_file, portable):
    """O_DIRECT is in effect on the repository's disk with either method; aligned reads
    into aligned buffers return the file's bytes, concurrent ones too."""
    path, data = disk_file
    with pread.open_reader(path, unbuffered=True, portable=portable) as r:
        assert r.io_mode == "o_direct" and r.fallback_reason is None
        assert r.method == ("seek" if portable else "preadv")
        bufs = [pread.aligned_buffer(8192), pread.aligned_buffer(4096)]
        r.readv_into(bufs, 16 * 4096)
        assert bytes(bufs[0]) + bytes(bufs[1]) == data[16 * 4096:19 * 4096]
        errors = []

        def worker(seed: int) -> None:
            rnd = random.Random(seed)
            buf = pread.aligned_buffer(4 * 4096)
            for _ in range(50):
                block = rnd.randrange(256 - 4)
                try:
                    r.readinto(buf, block * 4096)
                except OSError as e:
                    errors.append(f"{block}: {e}")
                    continue
                if bytes(buf) != data[block * 4096:(block + 4) * 4096]:
                    errors.append(block)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors


def test_the_setting_forces_the_portable_method(data_file, monkeypatch):
    path, _ = data_file
    monkeypatch.delenv(pread.PORTABLE_ENV, raising=False)
    with pread.open_reader(path, unbuffered=False) as r:
        assert r.method == "preadv"
    monkeypatch.setenv(pread.PORTABLE_ENV, "1")
    with pread.open_reader(path, unbuffered=False) as r:
        assert r.method == "seek"
    monkeypatch.setenv(pread.PORTABLE_ENV, "0")
    assert not pread.portable_forced()


def test_a_refused_o_direct_falls_back_to_buffered_with_a_code(disk_file, monkeypatch):
    path, data = disk_file
    real = os.open

    def refusing(p, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real(p, flags, *a, **kw)

    monkeypatch.setattr(os, "open", refusing)
    with pread.open_reader(path) as r:
        assert r.io_mode == "buffered" and r.fallback_code == "refused"
        assert "refuses O_DIRECT" in r.fallback_reason
        buf = bytearray(10)
        r.readinto(buf, 5)
        assert bytes(buf) == data[5:15]
