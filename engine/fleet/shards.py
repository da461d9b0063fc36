"""The agent's shard store: receives shards in chunks, resumable, hash-checked,
and holds each one on disk once.

Files, in <data>/shards/:
  <sha256>.json     what the controller announced: shard_id and size
  <sha256>.d/       a complete shard bundle (bundle.py), unpacked as it arrived
  <sha256>          a complete shard that is not a bundle (a plain file)
  <sha256>.d.part/  the members of a bundle received so far
  <sha256>.tar.log  the bundle's structure received so far (tar headers,
                    padding: 512 bytes a member plus the end blocks)
  <sha256>.part     the bytes received so far of a plain shard (and the first
                    512 bytes of any shard, until they say whether it is a tar)

Why unpack while receiving. Unpacking after the whole archive arrived holds the
shard twice (archive + folder) until the archive is deleted, and there is no
portable way to consume an archive in place. Streaming the members into the
staging folder as chunks arrive holds it once: peak disk = the shard's files +
the few-KB journal. The two things the old .part file gave stay true:
- Resume: chunks are still appended strictly in order, each checked against
  its own sha256 first, and every byte goes, unbuffered and in stream order,
  either to the journal or to the end of one member file. So after any
  interruption (a dropped link, a killed agent) journal + files are exactly a
  prefix of the archive: replaying the journal, reading each member's data
  from its file where a header says it comes, re-creates those bytes, hence
  the running sha256, the parser's state and have_bytes. Anything that does
  not replay cleanly (a file longer than its header, bytes after the point
  where the data stops) is thrown away and the transfer starts over.
- Content addressing: the whole-archive sha256 runs over every byte, structure
  and data, as before. The staging folder becomes <sha>.d (one rename) only
  once the last byte arrived, the hash matched and the tar ended properly;
  only <sha>.d is ever given to a worker. On a mismatch the staging folder is
  deleted: nothing half-written can be used.
A plain (non-tar) shard keeps the old layout: <sha>.part renamed to <sha>.

Room. PrepareRequest is refused ("refused", Refusal reason "disk" with need_bytes =
the bytes below and limit_bytes = the free space; the numbers in the message too) when the
disk's free space is less than the bytes still to come + `reserve` + what
transfers in flight on this agent still need: the unpacked shard is never
larger than its archive, so that is all a receive will ever write.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.fleet.bundle import BLOCK, BundleError, StreamUnpacker, is_bundle, looks_like_bundle, unpack
from engine.fleet.paths import ensure_private_dir, read_json, write_json
from engine.protocol.control import ShardInfo, is_sha256
from engine.protocol.errors import ProtocolError, Refusal

DISK_MARGIN = 512 * 1024 * 1024  # leave this much free on the disk
RESERVE_TTL_S = 600.0  # a transfer not touched for this long no longer holds room for its rest
MIN_BUNDLE = 2 * BLOCK  # a tar is at least one header + the end block; smaller shards are plain
_READ = 4 * 1024 * 1024


class NoRoom(ProtocolError):
    """Not enough free disk for a shard; need/free/reserve/others in bytes. On the
    wire: "refused" with Refusal("disk", need + reserve + others, free)."""

    def __init__(self, need: int, free: int, reserve: int, others: int) -> None:
        self.need, self.free, self.reserve, self.others = need, free, reserve, others
        held = f" + {_human(others)} for transfers in progress" if others else ""
        super().__init__(f"not enough disk space for the shard: {_human(need)} to receive + "
                         f"{_human(reserve)} kept free{held}, {_human(free)} free",
                         refusal=Refusal("disk", max(0, need) + reserve + others, max(0, free)))


@dataclass
class _Receive:
    """A shard being received (in memory; re-derived from disk after a restart)."""

    size: int  # announced bytes of the whole shard
    hash: Any  # running sha256 of bytes [0, have)
    have: int  # bytes received, = the offset of the next chunk
    kind: str  # "?" (first bytes not in yet), "plain" or "bundle"
    unpacker: StreamUnpacker | None = None  # the bundle's parser (kind "bundle")
    touched: float = 0.0  # monotonic time of the last Prepare/Chunk


class ShardStore:
    def __init__(self, root: Path, reserve: int = DISK_MARGIN) -> None:
        self.root = ensure_private_dir(root)
        self.reserve = reserve  # bytes always left free on the disk
        self._recv: dict[str, _Receive] = {}

    def _p(self, sha: str, suffix: str = "") -> Path:
        assert is_sha256(sha)  # the message types guarantee it; never a path from the wire
        return self.root / f"{sha}{suffix}"

    # ------------------------------------------------------------ what is here

    def cached_path(self, sha: str) -> Path | None:
        """The complete shard: its folder (a bundle) or its file; None if not here."""
        folder, plain = self._p(sha, ".d"), self._p(sha)
        if folder.is_dir():
            return folder
        return plain if plain.is_file() else None

    def shard_path(self, sha: str) -> Path | None:
        """What a worker loads: the shard's folder, or its file if it is not a
        bundle. A bundle archive left by an older agent is unpacked once and
        dropped (blocking: call off the event loop)."""
        path = self.cached_path(sha)
        if path is None or path.is_dir() or not is_bundle(path):
            return path
        try:
            folder = unpack(path, self._p(sha, ".d"))
        except BundleError as e:
            raise ProtocolError(f"cannot unpack the shard: {e}") from None
        path.unlink(missing_ok=True)
        return folder

    def meta(self, sha: str) -> dict | None:
        m = read_json(self._p(sha, ".json"), None)
        return m if isinstance(m, dict) and isinstance(m.get("size"), int) else None

    def have_bytes(self, sha: str) -> int:
        """Bytes received so far (from the disk when no receive is in memory)."""
        rec = self._recv.get(sha)
        if rec is not None:
            return rec.have
        n = _size(self._p(sha, ".part")) + _size(self._p(sha, ".tar.log"))
        staging = self._p(sha, ".d.part")
        if staging.is_dir():
            n += sum(_size(p) for p in staging.iterdir())
        return n

    def list(self) -> list[ShardInfo]:
        out = []
        for meta_path in sorted(self.root.glob("*.json")):
            sha = meta_path.stem
            meta = self.meta(sha) if is_sha256(sha) else None
            if meta is None:
                continue
            size = meta["size"]
            cached = self.cached_path(sha) is not None
            out.append(ShardInfo(str(meta.get("shard_id", sha))[:128] or sha, sha, size,
                                 size if cached else min(self.have_bytes(sha), size),
                                 "cached" if cached else "partial", None, None, None))
        return out

    # ------------------------------------------------------------ receiving

    async def prepare(self, shard_id: str, sha: str, size: int) -> tuple[bool, int]:
        """(cached, have_bytes) for an announced shard; sets up a resumable
        receive. Raises NoRoom before anything is written when the disk
        cannot take the rest of it."""
        if self.cached_path(sha):
            return True, size
        meta = self.meta(sha)
        fresh = meta is None or meta["size"] != size
        # Before anything is written or any prefix hashed: a refused shard leaves no trace.
        self._check_room(sha, size, 0 if fresh else min(self.have_bytes(sha), size))
        if fresh:  # new, or re-announced with another size (then the old prefix is useless)
            self._discard(sha)
            write_json(self._p(sha, ".json"), {"shard_id": shard_id, "size": size})
        rec = await self._state(sha, size)
        if size == 0:
            return self._finish(sha, rec), 0
        return False, rec.have

    async def write_chunk(self, sha: str, offset: int, data: bytes, chunk_sha: str) -> tuple[int, bool]:
        """Append one chunk; (have_bytes, complete). Raises ProtocolError for a
        chunk of an unannounced shard, out of order, too long or corrupted, or
        of a bundle that is not one we unpack."""
        if self.cached_path(sha):
            meta = self.meta(sha) or {"size": offset + len(data)}
            return meta["size"], True
        meta = self.meta(sha)
        if meta is None:
            raise ProtocolError("shard not prepared: send a PrepareRequest first", "not_found")
        if hashlib.sha256(data).hexdigest() != chunk_sha:
            raise ProtocolError("chunk sha256 mismatch; chunk dropped")
        rec = await self._state(sha, meta["size"])
        if offset != rec.have:
            raise ProtocolError(f"chunk at offset {offset}, expected {rec.have}; prepare again to resume")
        if offset + len(data) > rec.size:
            raise ProtocolError("chunk runs past the announced size")
        try:
            if rec.kind == "bundle":
                self._feed(sha, rec, data)
            else:
                with open(self._p(sha, ".part"), "ab", buffering=0) as f:
                    _write_all(f, data)
            rec.hash.update(data)
            rec.have += len(data)
            if rec.kind == "?":
                self._decide(sha, rec)
        except BundleError as e:
            self._discard(sha)
            raise ProtocolError(f"cannot unpack the shard: {e}; partial discarded") from None
        except BaseException as e:
            self._recv.pop(sha, None)  # what reached the disk is still a prefix: re-derive it
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise NoRoom(rec.size - offset, shutil.disk_usage(self.root).free, self.reserve, 0) from None
            raise
        if rec.have < rec.size:
            return rec.have, False
        if rec.kind == "bundle":  # on the disk before it is called complete (a power cut after)
            await asyncio.to_thread(_sync_files, self._p(sha, ".d.part"))
        return rec.have, self._finish(sha, rec)

    # ------------------------------------------------------------ internals

    def _check_room(self, sha: str, size: int, have: int) -> None:
        need = size - have
        if need <= 0:
            return
        now = time.monotonic()
        others = sum(r.size - r.have for s, r in self._recv.items()
                     if s != sha and now - r.touched < RESERVE_TTL_S)
        free = shutil.disk_usage(self.root).free
        if free < need + others + self.reserve:
            raise NoRoom(need, free, self.reserve, others)

    async def _state(self, sha: str, size: int) -> _Receive:
        """The receive in memory, else re-derived from the disk (off the loop)."""
        rec = self._recv.get(sha)
        if rec is None or rec.size != size:
            rec = await asyncio.to_thread(self._recover, sha, size)
            self._recv[sha] = rec
        rec.touched = time.monotonic()
        return rec

    def _recover(self, sha: str, size: int) -> _Receive:
        log, staging, part = self._p(sha, ".tar.log"), self._p(sha, ".d.part"), self._p(sha, ".part")
        if log.exists() or staging.exists():
            part.unlink(missing_ok=True)  # a crash while switching to the bundle: the journal rules
            try:
                h, have, unpacker = _replay(log, staging)
            except _Broken:
                self._discard(sha)
            else:
                if have <= size:
                    return _Receive(size, h, have, "bundle", unpacker)
                self._discard(sha)
            return _Receive(size, hashlib.sha256(), 0, self._first_kind(size))
        have = _size(part)
        if have > size:  # cannot be a prefix: start over
            part.unlink()
            have = 0
        rec = _Receive(size, _hash_prefix(part, have), have, self._first_kind(size))
        if rec.kind == "?":
            self._decide(sha, rec)
        return rec

    @staticmethod
    def _first_kind(size: int) -> str:
        return "?" if size >= MIN_BUNDLE else "plain"

    def _decide(self, sha: str, rec: _Receive) -> None:
        """Once the first block is in: a tar goes on as a bundle (the bytes so
        far move from .part into the journal and staging folder)."""
        part = self._p(sha, ".part")
        if rec.have < BLOCK:
            return
        with open(part, "rb") as f:
            head = f.read()  # under one chunk (8 MiB) + 511 bytes
        if not looks_like_bundle(head):
            rec.kind = "plain"
            return
        rec.kind, rec.unpacker = "bundle", StreamUnpacker()
        try:
            self._feed(sha, rec, head)
        except BundleError as e:
            self._discard(sha)
            raise ProtocolError(f"cannot unpack the shard: {e}; partial discarded") from None
        part.unlink()

    def _feed(self, sha: str, rec: _Receive, data: bytes) -> None:
        """Split data into the journal and the member files, in stream order,
        unbuffered, so what is on disk is always a prefix of the archive."""
        staging = self._p(sha, ".d.part")
        staging.mkdir(mode=0o700, exist_ok=True)
        view, u = memoryview(data), rec.unpacker
        assert u is not None
        with open(self._p(sha, ".tar.log"), "ab", buffering=0) as log:
            while view:
                member, room = u.want()
                piece, view = view[:room], view[room:]
                started = u.take(piece)  # raises BundleError before a bad member's bytes land
                if member is not None:
                    with open(staging / member, "ab", buffering=0) as f:
                        _write_all(f, piece)
                else:
                    _write_all(log, piece)
                if started:
                    (staging / started).touch()

    def _finish(self, sha: str, rec: _Receive) -> bool:
        self._recv.pop(sha, None)
        digest = rec.hash.hexdigest()
        if digest != sha:
            self._discard(sha)  # the prefix is wrong somewhere: start over
            raise ProtocolError(f"shard sha256 mismatch (got {digest[:16]}...); partial discarded")
        if rec.kind == "bundle":
            assert rec.unpacker is not None
            try:
                rec.unpacker.finish()
            except BundleError as e:
                self._discard(sha)
                raise ProtocolError(f"cannot unpack the shard: {e}; partial discarded") from None
            os.replace(self._p(sha, ".d.part"), self._p(sha, ".d"))
            self._p(sha, ".tar.log").unlink(missing_ok=True)
            return True
        part = self._p(sha, ".part")
        if not part.exists():
            part.touch()
        os.replace(part, self._p(sha))
        return True

    def _discard(self, sha: str) -> None:
        """Forget a partial receive (the announcement stays)."""
        self._recv.pop(sha, None)
        self._p(sha, ".part").unlink(missing_ok=True)
        self._p(sha, ".tar.log").unlink(missing_ok=True)
        shutil.rmtree(self._p(sha, ".d.part"), ignore_errors=True)


class _Broken(Exception):
    """Journal and staging folder are not a prefix of one archive."""


def _replay(log: Path, staging: Path) -> tuple[Any, int, StreamUnpacker]:
    """Re-derive (sha256, have, parser) of a bundle's received prefix from its
    journal and member files: the bytes in stream order, as they arrived."""
    journal = log.read_bytes() if log.exists() else b""
    files: dict[str, int] = {}
    if staging.exists():
        for p in staging.iterdir():
            if not p.is_file() or p.is_symlink():
                raise _Broken(p.name)
            files[p.name] = p.stat().st_size
    h, u, jpos, used = hashlib.sha256(), StreamUnpacker(), 0, {}
    try:
        while True:
            member, room = u.want()
            if member is None:
                piece = journal[jpos:jpos + room]
                if not piece:
                    break
                jpos += len(piece)
                started = u.take(piece)
                h.update(piece)
                if started:
                    used[started] = 0
                    (staging / started).touch()  # a crash may have come before it was made
                continue
            left = files.get(member, 0) - used[member]
            if left <= 0:
                break
            with open(staging / member, "rb") as f:
                f.seek(used[member])
                while left > 0 and u.want()[0] == member:
                    block = f.read(min(_READ, left, u.want()[1]))
                    if not block:
                        raise _Broken(member)
                    u.take(block)
                    h.update(block)
                    used[member] += len(block)
                    left -= len(block)
    except BundleError as e:
        raise _Broken(str(e)) from None
    if jpos != len(journal) or any(files[n] != used.get(n, -1) for n in files):
        raise _Broken("journal and files disagree")
    return h, u.pos, u


def _sync_files(folder: Path) -> None:
    for p in folder.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def _write_all(f: Any, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[f.write(view):]


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0


def _human(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _hash_prefix(path: Path, length: int | None) -> Any:
    """sha256 of the first length bytes of path (all if None; none if missing)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            left = length
            while left is None or left > 0:
                block = f.read(_READ if left is None else min(left, _READ))
                if not block:
                    break
                h.update(block)
                if left is not None:
                    left -= len(block)
    except FileNotFoundError:
        pass
    return h
