"""Which reads a store checksums: first reads, every read again once the file changed, every read while fresh."""

import os
import time

import numpy as np
import pytest

from engine.platform import read_checks
from engine.platform.read_checks import ReadChecks


@pytest.fixture
def blob_file(tmp_path):
    path = tmp_path / "blobs.bin"
    path.write_bytes(bytes(4096 * 8))
    fd = os.open(path, os.O_RDONLY)
    yield path, fd
    os.close(fd)


def _check(checks, fd, ids):
    """One read of `ids` as a store does it: the mask to check, then those marked passed."""
    ids = np.asarray(ids)
    need, token = checks.needed(0, fd, ids)
    checks.passed(0, ids[need], token)
    return need.tolist()


def test_a_blob_is_checked_on_its_first_read_only(blob_file, monkeypatch):
    monkeypatch.setattr(read_checks, "SETTLE_S", 0.0)  # the file counts as settled at once
    _path, fd = blob_file
    checks = ReadChecks("first", [8])
    assert _check(checks, fd, [1, 2]) == [True, True]
    assert _check(checks, fd, [1, 2, 3]) == [False, False, True]
    assert _check(checks, fd, [3]) == [False]


def test_a_write_to_the_file_after_a_check_makes_every_blob_checked_again(blob_file, monkeypatch):
    monkeypatch.setattr(read_checks, "SETTLE_S", 0.0)
    path, fd = blob_file
    checks = ReadChecks("first", [8])
    assert _check(checks, fd, [1, 5]) == [True, True]
    time.sleep(0.05)  # past the time stamps' granularity (a clock tick)
    with open(path, "r+b") as f:  # the same size, one byte of blob 5 changed in place
        f.seek(5 * 4096 + 10)
        f.write(b"\x01")
    assert _check(checks, fd, [1, 5]) == [True, True]  # not only the blob written: the file changed
    assert _check(checks, fd, [1, 5]) == [False, False]


def test_a_write_that_puts_the_old_modification_time_back_is_still_seen(blob_file, monkeypatch):
    monkeypatch.setattr(read_checks, "SETTLE_S", 0.0)
    path, fd = blob_file
    old = time.time() - 3600
    os.utime(path, (old, old))
    checks = ReadChecks("first", [8])
    assert _check(checks, fd, [2]) == [True]
    time.sleep(0.05)
    with open(path, "r+b") as f:
        f.seek(2 * 4096)
        f.write(b"\x07")
    os.utime(path, (old, old))  # mtime as it was; the change time cannot be set back
    assert _check(checks, fd, [2]) == [True]


def test_a_freshly_written_file_is_checked_on_every_read(blob_file):
    _path, fd = blob_file  # written just now: younger than SETTLE_S
    checks = ReadChecks("first", [8])
    for _ in range(3):
        assert _check(checks, fd, [0, 1]) == [True, True]


def test_a_check_that_raced_a_change_marks_nothing(blob_file, monkeypatch):
    monkeypatch.setattr(read_checks, "SETTLE_S", 0.0)
    path, fd = blob_file
    checks = ReadChecks("first", [8])
    need, token = checks.needed(0, fd, np.array([4]))  # read under the old file...
    time.sleep(0.05)
    with open(path, "r+b") as f:
        f.write(b"\x02")
    assert _check(checks, fd, [6]) == [True]  # ...another read sees the file changed...
    checks.passed(0, np.array([4]), token)  # ...so the first read's pass is not taken for the new file
    assert _check(checks, fd, [4]) == [True]


def test_always_and_never_and_forget(blob_file, monkeypatch):
    monkeypatch.setattr(read_checks, "SETTLE_S", 0.0)
    _path, fd = blob_file
    always, never, first = ReadChecks("always", [8]), ReadChecks("never", [8]), ReadChecks("first", [8])
    for _ in range(2):
        assert _check(always, fd, [0, 1]) == [True, True]
        assert _check(never, fd, [0, 1]) == [False, False]
    assert _check(first, fd, [0]) == [True] and _check(first, fd, [0]) == [False]
    first.forget()
    assert _check(first, fd, [0]) == [True]
    with pytest.raises(ValueError, match="verify must be one of"):
        ReadChecks("sometimes", [8])
