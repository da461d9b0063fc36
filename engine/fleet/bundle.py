"""Shard bundles: one file per exported shard folder, so the agent's
content-addressed, resumable, hash-checked store (shards.py) can carry it.

A bundle is an uncompressed POSIX tar of the folder's regular files, sorted,
with zeroed owners and times: the same shard always gives the same bytes, so
the same sha256, and an agent that has it never receives it again. (IR
weights do not compress much; not compressing keeps packing at disk speed.)

The controller never writes the archive either: it sends a BundleView
(bundle_view.py), the tar's bytes made on the fly from the shard folder, and
keeps only its sha256 in its cache (`<shard key>.sha256`).
The agent never stores the archive: `StreamUnpacker` splits the bytes as they
arrive into member data (written straight into the shard's staging folder)
and structure (headers, pax records, padding, end blocks: a few KB, kept in a
journal so an interrupted receive can be re-derived, see shards.py), so a
peer holds the shard about once, never twice. The controller is paired
(trusted), but unpacking still refuses anything but plain files with plain
names: no paths, links, devices, sparse files or `..`, checked on each header
before any byte of that member is written.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.fleet.bundle_view import BundleView

BUNDLE_SUFFIX = ".tar"
MAX_MEMBERS = 64  # a shard is shard.xml/.bin/.json; leave room, refuse floods
MAX_PAX_BYTES = 64 * 1024  # pax records of one member (path, size); ours are < 100 bytes
BLOCK = tarfile.BLOCKSIZE  # 512: tar headers and member data are padded to it
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}\Z")
_PLAIN = (tarfile.REGTYPE, tarfile.AREGTYPE)  # not CONTTYPE/GNUTYPE_SPARSE, whose data is laid out otherwise


class BundleError(ValueError):
    """Not a shard bundle we are willing to unpack; str(e) says why."""


def pack(folder: Path, out: Path) -> tuple[Path, str]:
    """Write folder's bundle into out (atomically); (out, sha256). The controller does not
    need this (it sends a BundleView straight from the folder); tests and tools do."""
    from engine.fleet.bundle_view import BundleView, BundleViewError

    try:
        view = BundleView(folder)
    except BundleViewError as e:
        raise BundleError(str(e)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as raw, view.open() as src:
            for block in iter(lambda: src.read(4 << 20), b""):
                h.update(block)
                raw.write(block)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out, h.hexdigest()


def cached_bundle(folder: Path, cache: Path) -> tuple[BundleView, str]:
    """The bundle of folder as a BundleView, and its sha256 -- hashed on the first call
    and kept in cache/<folder name>.sha256 (the folder's name is the shard's content key;
    the hash is redone if a file in it is newer). No archive is written: the controller's
    disk holds the shard once. An archive an earlier version packed there is removed."""
    from engine.fleet.bundle_view import BundleView, BundleViewError

    folder = Path(folder)
    try:
        view = BundleView(folder)
    except BundleViewError as e:
        raise BundleError(str(e)) from None
    cache = Path(cache)
    (cache / f"{folder.name}{BUNDLE_SUFFIX}").unlink(missing_ok=True)  # <= v0.1's packed copy: disk back
    sha_file = cache / f"{folder.name}.sha256"
    newest = max(p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file())
    try:
        if sha_file.stat().st_mtime_ns >= newest:
            sha = sha_file.read_text().strip()
            if re.fullmatch(r"[0-9a-f]{64}", sha):
                return view, sha
    except OSError:
        pass
    sha = view.sha256()
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{sha_file.name}.", dir=cache)
    with os.fdopen(fd, "w") as f:
        f.write(sha + "\n")
    os.replace(tmp, sha_file)
    return view, sha


def looks_like_bundle(head: bytes) -> bool:
    """Whether a stream starting with head (>= 512 bytes) is a tar: its first
    block is a header with a valid checksum and the ustar magic."""
    if len(head) < BLOCK or head[257:262] != b"ustar":
        return False
    try:
        tarfile.TarInfo.frombuf(bytes(head[:BLOCK]), "utf-8", "surrogateescape")
    except (tarfile.HeaderError, ValueError):
        return False
    return True


def is_bundle(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return looks_like_bundle(f.read(BLOCK))
    except OSError:
        return False


class StreamUnpacker:
    """A shard bundle parsed as its bytes arrive, in pieces of any size.

    want() says what the next bytes of the stream are: (name, n) = up to n
    bytes of member `name`'s data, (None, n) = up to n bytes of structure.
    take(piece) consumes at most that many; when a member's header completes,
    take() returns its name (the caller creates its file, even if empty).
    Every check happens in take(), on the header, before any data of the
    member is handed out. The state is small and is re-derived by replaying
    the stream (shards.py), so it is never persisted.
    """

    def __init__(self) -> None:
        self.pos = 0  # stream bytes taken
        self.members: list[str] = []  # member names, in stream order
        self._hdr = bytearray()  # the header block being gathered
        self._pax: bytearray | None = None  # pax records being gathered
        self._pending: dict[str, str] = {}  # pax records for the next member
        self._member: str | None = None  # member whose data comes next
        self._left = 0  # bytes left of that member's data (or of the pax records)
        self._pad = 0  # padding bytes up to the next block
        self._ended = False  # the end-of-archive block came: only padding follows

    def want(self) -> tuple[str | None, int]:
        if self._member is not None:
            return self._member, self._left
        if self._pax is not None:
            return None, self._left
        if self._pad:
            return None, self._pad
        if self._ended:
            return None, 1 << 62  # the end blocks and record padding (zeros), up to the size
        return None, BLOCK - len(self._hdr)

    def take(self, piece: bytes | memoryview) -> str | None:
        member, room = self.want()
        n = len(piece)
        assert 0 < n <= room, (n, room)
        self.pos += n
        if member is not None:
            self._left -= n
            if not self._left:
                self._member = None
        elif self._pax is not None:
            self._pax += piece
            self._left -= n
            if not self._left:
                self._pending, self._pax = _pax_records(bytes(self._pax)), None
        elif self._pad:
            self._pad -= n
        elif not self._ended:
            self._hdr += piece
            if len(self._hdr) == BLOCK:
                block = bytes(self._hdr)
                self._hdr.clear()
                return self._header(block)
        return None

    def finish(self) -> None:
        """The stream is over: raise BundleError unless it ended as a tar does."""
        if not self._ended or self._member is not None or self._pax is not None:
            raise BundleError("truncated shard bundle (no end-of-archive block)")

    def _header(self, block: bytes) -> str | None:
        if block.count(0) == BLOCK:
            if not self.members or self._pending:
                raise BundleError("empty shard bundle")
            self._ended = True
            return None
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except (tarfile.HeaderError, ValueError) as e:
            raise BundleError(f"not a shard bundle: {e}") from None
        if info.type == tarfile.XHDTYPE:
            if self._pending:
                raise BundleError("two pax headers in a row")
            if not 0 <= info.size <= MAX_PAX_BYTES:
                raise BundleError(f"pax header of {info.size} bytes (at most {MAX_PAX_BYTES})")
            self._pad = -info.size % BLOCK
            if info.size:
                self._pax, self._left = bytearray(), info.size
            return None
        pending, self._pending = self._pending, {}
        name = pending.get("path", info.name)
        size = int(pending["size"]) if "size" in pending else info.size
        if info.type not in _PLAIN or not _NAME.match(name) or name in (".", ".."):
            raise BundleError(f"refusing bundle member {name[:80]!r}: plain files only")
        if name in self.members:
            raise BundleError(f"bundle member {name!r} appears twice")
        if len(self.members) >= MAX_MEMBERS:
            raise BundleError(f"a shard bundle holds at most {MAX_MEMBERS} files")
        if size < 0:
            raise BundleError(f"bundle member {name!r} has a negative size")
        self.members.append(name)
        self._pad = -size % BLOCK
        if size:
            self._member, self._left = name, size
        return name


def _pax_records(buf: bytes) -> dict[str, str]:
    """Parse pax records ("<len> <key>=<value>\\n"...); keep path and size,
    refuse what changes how the data is laid out (sparse files)."""
    out, pos = {}, 0
    while pos < len(buf):
        sp = buf.find(b" ", pos, pos + 12)
        length = int(buf[pos:sp]) if sp > pos and buf[pos:sp].isdigit() else 0
        rec = buf[sp + 1:pos + length]
        if length <= 0 or pos + length > len(buf) or not rec.endswith(b"\n") or b"=" not in rec:
            raise BundleError("malformed pax header")
        key, _, value = rec[:-1].partition(b"=")
        if key.startswith(b"GNU.sparse"):
            raise BundleError("refusing a sparse file in a shard bundle")
        if key == b"size":
            if not value.isdigit():
                raise BundleError("malformed pax size")
            out["size"] = value.decode()
        elif key == b"path":
            out["path"] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def unpack(bundle: Path, target: Path) -> Path:
    """Unpack a bundle file into target (atomically: a temp folder renamed into
    place; an existing target is reused). Returns target. The agent unpacks
    while receiving (shards.py); this is for bundles already on disk."""
    target = Path(target)
    if target.is_dir():
        return target
    if not is_bundle(bundle):
        raise BundleError("not a shard bundle (no tar header)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        parser = StreamUnpacker()
        with open(bundle, "rb") as src:
            block = b""
            while True:
                if not block:
                    block = src.read(4 * 1024 * 1024)
                    if not block:
                        break
                member, room = parser.want()
                piece, block = block[:room], block[room:]
                started = parser.take(piece)
                if started:
                    (tmp / started).touch()
                if member is not None:
                    with open(tmp / member, "ab") as dst:
                        dst.write(piece)
        parser.finish()
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.is_dir():  # not a concurrent unpack of the same bundle
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
