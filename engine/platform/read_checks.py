"""Which blob reads a store must checksum: every blob's first read, and again once its file changed.

Both disk stores (engine/moe/store.py's experts, engine/sparse/store.py's neuron bundles)
keep a checksum per blob so that a damaged file raises an error naming the blob instead of
computing with garbage. Checking every read costs compute the engines need: xxh3 over the
experts a token reads took a measurable share of Bevy's time on two cores
(`bench moe ... bevy_verify_always`). So by default ("first") a blob is checked on its first
read, and every read after that is checked again once the file is no longer the file those
checks saw:

* its identity -- device, inode, size, modification time, change time, from one fstat of
  the open descriptor *after* the read -- differs from the one recorded at the check: then
  every blob of that file is unchecked again. A write through the file system (an editor,
  a re-download, a disk tool, a half-finished copy into place) moves the modification and
  change times; a file replaced by rename leaves our descriptor on the old, checked inode;
* or its last modification or change is under SETTLE_S seconds old: time stamps are coarse
  (a clock tick on Linux, 2 s on FAT), so two writes close together may share one. While a
  file is that fresh, every read is checked and nothing is marked checked.

What this leaves unchecked after the first read: bytes that change on the medium without
going through the file system (the drive's own error correction reports those as failed
reads). "always" checks every read; "never" none (benchmark ablations only).

The same on every OS: os.fstat fills st_ino, st_mtime_ns and st_ctime_ns on Windows too
(there st_ctime is the creation time; the last-write time still moves on a write)."""

from __future__ import annotations

import os
import threading
import time
from typing import NamedTuple, Sequence

import numpy as np

VERIFY_MODES = ("always", "first", "never")
SETTLE_S = 5.0  # a file changed more recently than this is checked on every read


class FileIdentity(NamedTuple):
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def identity_of(fd: int) -> FileIdentity:
    st = os.fstat(fd)
    return FileIdentity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def settled(ident: FileIdentity, now: float) -> bool:
    """True if the file's last change is at least SETTLE_S old (and not in the future)."""
    return now - max(ident.mtime_ns, ident.ctime_ns) / 1e9 >= SETTLE_S


class ReadChecks:
    """Per file, which blobs have passed their checksum since the file last changed. Thread-safe.

    After a read: `need, token = checks.needed(file, fd, ids)` -> a bool mask over `ids` of the
    blobs to checksum now; once they passed, `checks.passed(file, ids[need], token)`."""

    def __init__(self, mode: str, blobs_per_file: Sequence[int]) -> None:
        if mode not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {mode!r}")
        self.mode = mode
        self._checked = [np.zeros(int(n), dtype=bool) for n in blobs_per_file]
        self._identity: list[FileIdentity | None] = [None] * len(self._checked)
        self._lock = threading.Lock()

    def needed(self, file: int, fd: int, ids: np.ndarray) -> tuple[np.ndarray, FileIdentity | None]:
        """Mask of `ids` (blob indices in `file`, read just now through `fd`) to checksum, and
        the token to hand to passed(). Call after the read, so a write that raced it shows."""
        n = len(ids)
        if self.mode != "first":
            return np.full(n, self.mode == "always"), None
        ident = identity_of(fd)
        with self._lock:
            if ident != self._identity[file]:
                self._checked[file][:] = False  # another file than the one checked: check again
                self._identity[file] = ident
            if not settled(ident, time.time()):
                return np.ones(n, dtype=bool), None  # too fresh to trust a time stamp: check, mark nothing
            return ~self._checked[file][ids], ident

    def passed(self, file: int, ids: np.ndarray, token: FileIdentity | None) -> None:
        """`ids` of `file` matched their checksums, read while the file had identity `token`."""
        if token is None:
            return
        with self._lock:
            if self._identity[file] == token:  # not changed since: a concurrent read saw no other file
                self._checked[file][ids] = True

    def forget(self) -> None:
        """Uncheck every blob (the next read of each is checked)."""
        with self._lock:
            for c in self._checked:
                c[:] = False
