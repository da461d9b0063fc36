"""A shard bundle read straight from its folder: the tar's bytes made on the fly.

The bundle of a shard folder is a deterministic tar (engine/fleet/bundle.py: sorted plain
files, zeroed owners and times, PAX format), so its layout is known from the file names and
sizes alone: per file a header, the file's bytes, zero padding to 512; then two zero blocks
and padding to the 10 KiB record. BundleView maps a byte offset of that stream to a header,
a file or padding, so the controller can send (and resume) a bundle without ever writing it:
the controller's disk holds a shard once, not shard + archive (an 8B model at fp16 is 16 GB
of shards; a second 16 GB for the archive is what a full disk refused).

    view = BundleView(folder)          # layout only: reads no file data
    view.size                          # the bundle's length in bytes
    with view.open() as f:             # a seekable, read-only binary file
        f.seek(offset); f.read(n)
    view.sha256()                      # one streaming pass over the files

The bytes are those of Python's tarfile writing the same members (tests/engine/fleet/
test_fleet_bundle_view.py checks byte equality), so a bundle's sha256 did not change.
A file that changes size while a view is open is an error (BundleError), not a corrupt send.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

BLOCK = tarfile.BLOCKSIZE  # 512
RECORD = tarfile.RECORDSIZE  # 10240: tarfile pads the archive's end to a whole record
READ_BYTES = 4 << 20  # sha256 pass: bytes per read


class BundleViewError(ValueError):
    """The folder cannot be a bundle (empty), or a file changed under the view."""


@dataclass(frozen=True)
class _Segment:
    start: int  # offset of this segment in the bundle
    length: int
    data: bytes | None  # header or padding bytes; None = the bytes of `path`
    path: Path | None = None


def bundle_files(folder: Path) -> list[Path]:
    """The files a bundle of folder holds: regular, not hidden, sorted by name."""
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and not p.name.startswith("."))


def member_header(name: str, size: int) -> bytes:
    """The tar header block(s) of one member, as tarfile.addfile writes them in PAX format."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode, info.mtime, info.uid, info.gid = 0o644, 0, 0, 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")


class BundleView:
    """The bundle of `folder`, never written to disk (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        files = bundle_files(self.folder)
        if not files:
            raise BundleViewError(f"{self.folder} holds no files")
        segments: list[_Segment] = []
        pos = 0

        def add(length: int, data: bytes | None, path: Path | None = None) -> None:
            nonlocal pos
            if length:
                segments.append(_Segment(pos, length, data, path))
                pos += length

        for p in files:
            size = p.stat().st_size
            header = member_header(p.name, size)
            add(len(header), header)
            add(size, None, p)
            add(-size % BLOCK, bytes(-size % BLOCK))
        add(2 * BLOCK, bytes(2 * BLOCK))
        add(-pos % RECORD, bytes(-pos % RECORD))
        self.size = pos
        self.segments = segments
        self._starts = [s.start for s in segments]

    def __repr__(self) -> str:
        return f"BundleView({str(self.folder)!r}, size={self.size})"

    def open(self) -> io.BufferedReader:
        return io.BufferedReader(_ViewReader(self), buffer_size=1 << 20)

    def sha256(self) -> str:
        h = hashlib.sha256()
        with self.open() as f:
            for block in iter(lambda: f.read(READ_BYTES), b""):
                h.update(block)
        return h.hexdigest()

    def segment_at(self, offset: int) -> int:
        """Index of the segment holding bundle byte `offset` (0 <= offset < size)."""
        return bisect.bisect_right(self._starts, offset) - 1


class _ViewReader(io.RawIOBase):
    """Raw reads of a BundleView: headers and padding from memory, data from the files
    (kept open while the reader is, one descriptor per file at most)."""

    def __init__(self, view: BundleView) -> None:
        self.view, self.pos = view, 0
        self._files: dict[Path, io.FileIO] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.view.size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self.pos = base + offset
        return self.pos

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        done = 0
        while done < len(out) and self.pos < self.view.size:
            seg = self.view.segments[self.view.segment_at(self.pos)]
            within = self.pos - seg.start
            n = min(len(out) - done, seg.length - within)
            if seg.data is not None:
                out[done:done + n] = seg.data[within:within + n]
            else:
                got = self._file(seg.path).readinto(out[done:done + n]) if n else 0
                if got != n:
                    raise BundleViewError(f"{seg.path} changed while it was being sent (short read)")
            done += n
            self.pos += n
        return done

    def _file(self, path: Path | None) -> io.FileIO:
        assert path is not None
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = io.FileIO(path, "r")
        seg = self.view.segments[self.view.segment_at(self.pos)]
        f.seek(self.pos - seg.start)
        return f

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        super().close()
