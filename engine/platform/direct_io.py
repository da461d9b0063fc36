"""Unbuffered reads, and whether they are really in effect: the one probe both offload
stores (engine/moe/store.py, engine/sparse/store.py) open their files through, so a
benchmark can tell disk figures from page-cache ones (O_DIRECT on tmpfs reads RAM)."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import Any

from engine.platform import pread

IO_MODES = pread.IO_MODES  # "o_direct" (Linux), "no_buffering" (Windows), "f_nocache" (macOS), "buffered"
RAM_FILE_SYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}  # statfs f_type magic numbers


def fs_type(path: Path | str) -> str | None:
    """The name of the RAM-backed file system holding `path` ("tmpfs", "ramfs"),
    "other" for any other one, None when it cannot be told (not Linux, statfs failed)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on x86_64/aarch64); f_type first
        if libc.statfs(os.fsencode(str(path)), buf) != 0:
            return None
        magic = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    except (OSError, AttributeError, ValueError):
        return None
    return RAM_FILE_SYSTEMS.get(magic, "other")


def open_for_reads(path: Path | str, direct: bool = True, portable: bool | None = None) -> pread.Reader:
    """Open `path` for positional reads (engine/platform/pread.py), unbuffered when `direct`
    and it is really in effect; `reader.fallback_reason` is None then, else why reads are
    buffered (no unbuffered mode on this OS, refused by the file system, a probe read
    failing, or the file living in RAM (tmpfs/ramfs), where reads never come from a disk).
    portable: the lock + seek + readinto reader of Windows on any OS (None: FLOTILLA_PORTABLE_IO)."""
    if not direct:
        return pread.open_reader(path, unbuffered=False, portable=portable)
    ram = fs_type(path)
    if ram in RAM_FILE_SYSTEMS.values():
        reader = pread.open_reader(path, unbuffered=False, portable=portable)
        reader.fallback_code = "ram"
        reader.fallback_reason = (f"the file is on {ram}, which is RAM: reads never come from a disk, "
                                  "so O_DIRECT cannot keep the page cache out of the figures")
        return reader
    return pread.open_reader(path, unbuffered=True, portable=portable)


class DirectIOReport:
    """What a store's reads go through, for its figures. The store sets, at open:
    `io_fallback_reason` (None unless an unbuffered open fell back, for any of its files),
    `io_unbuffered` (the mode asked of this OS: "o_direct", "no_buffering", "f_nocache")
    and `io_reader` (how reads happen: "preadv", "pread", "seek" -- the portable
    fallback, forced by FLOTILLA_PORTABLE_IO=1 -- or "aio" for the sparse store's
    Linux native AIO). Needs `config.direct` (asked for). Both stores use it."""

    config: Any
    io_fallback_reason: str | None = None
    io_unbuffered: str = "o_direct"
    io_reader: str = "preadv"

    @property
    def io_requested(self) -> str:
        """The OS's unbuffered mode or "buffered": what the config asked for."""
        return self.io_unbuffered if self.config.direct else "buffered"

    @property
    def io_mode(self) -> str:
        """One of IO_MODES: what reads really go through (every file)."""
        return self.io_requested if self.io_fallback_reason is None else "buffered"

    def io_info(self) -> dict[str, str | None]:
        """{"requested", "effective", "fallback_reason"}."""
        return {"requested": self.io_requested, "effective": self.io_mode,
                "fallback_reason": self.io_fallback_reason}
