"""The agent's shard store: receives shards in chunks, resumable, hash-checked.

Files, in <data>/shards/:
  <sha256>        a complete shard whose SHA-256 matched (content-addressed,
                  so a shard is never received twice, whatever its name)
  <sha256>.part   bytes received so far, always a prefix of the shard
  <sha256>.json   what the controller announced: shard_id and size

Chunks are appended strictly in order and each carries its own SHA-256, so a
corrupted chunk never reaches the disk, and the .part file is a valid prefix
after any interruption (a dropped link, a killed agent): PrepareRequest again
and the reply's have_bytes says where to go on. The whole-shard hash is kept
running while chunks arrive, so the final check costs nothing; after a restart
the prefix is hashed once, off the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from pathlib import Path

from engine.fleet.paths import ensure_private_dir, read_json, write_json
from engine.protocol.control import ShardInfo, is_sha256
from engine.protocol.errors import ProtocolError

DISK_MARGIN = 512 * 1024 * 1024  # leave this much free on the disk


class ShardStore:
    def __init__(self, root: Path) -> None:
        self.root = ensure_private_dir(root)
        self._hash: dict[str, tuple[object, int]] = {}  # sha -> (running sha256, bytes hashed)

    def _p(self, sha: str, suffix: str = "") -> Path:
        assert is_sha256(sha)  # the message types guarantee it; never a path from the wire
        return self.root / f"{sha}{suffix}"

    def cached_path(self, sha: str) -> Path | None:
        p = self._p(sha)
        return p if p.is_file() else None

    def meta(self, sha: str) -> dict | None:
        m = read_json(self._p(sha, ".json"), None)
        return m if isinstance(m, dict) and isinstance(m.get("size"), int) else None

    def have_bytes(self, sha: str) -> int:
        try:
            return self._p(sha, ".part").stat().st_size
        except FileNotFoundError:
            return 0

    async def prepare(self, shard_id: str, sha: str, size: int) -> tuple[bool, int]:
        """(cached, have_bytes) for an announced shard; sets up a resumable receive."""
        if self.cached_path(sha):
            return True, size
        meta = self.meta(sha)
        if meta is None or meta["size"] != size:
            # New, or re-announced with another size (then the old prefix is useless).
            self._p(sha, ".part").unlink(missing_ok=True)
            self._hash.pop(sha, None)
            write_json(self._p(sha, ".json"), {"shard_id": shard_id, "size": size})
        have = self.have_bytes(sha)
        if have > size:  # cannot be a prefix: start over
            self._p(sha, ".part").unlink()
            self._hash.pop(sha, None)
            have = 0
        need = size - have
        if need and shutil.disk_usage(self.root).free < need + DISK_MARGIN:
            raise ProtocolError(f"not enough disk space for a {size}-byte shard", "overloaded")
        if self._hash.get(sha, (None, -1))[1] != have:
            self._hash[sha] = (await asyncio.to_thread(_hash_prefix, self._p(sha, ".part"), have), have)
        if size == 0:
            return await self._finish(sha), 0
        return False, have

    async def write_chunk(self, sha: str, offset: int, data: bytes, chunk_sha: str) -> tuple[int, bool]:
        """Append one chunk; (have_bytes, complete). Raises ProtocolError for a
        chunk of an unannounced shard, out of order, too long or corrupted."""
        if self.cached_path(sha):
            meta = self.meta(sha) or {"size": offset + len(data)}
            return meta["size"], True
        meta = self.meta(sha)
        if meta is None:
            raise ProtocolError("shard not prepared: send a PrepareRequest first", "not_found")
        have = self.have_bytes(sha)
        if offset != have:
            raise ProtocolError(f"chunk at offset {offset}, expected {have}; prepare again to resume")
        if offset + len(data) > meta["size"]:
            raise ProtocolError("chunk runs past the announced size")
        if hashlib.sha256(data).hexdigest() != chunk_sha:
            raise ProtocolError("chunk sha256 mismatch; chunk dropped")
        running = self._hash.get(sha)
        if running is None or running[1] != have:
            running = (await asyncio.to_thread(_hash_prefix, self._p(sha, ".part"), have), have)
        with open(self._p(sha, ".part"), "ab") as f:
            f.write(data)
        running[0].update(data)  # type: ignore[attr-defined]
        have += len(data)
        self._hash[sha] = (running[0], have)
        if have < meta["size"]:
            return have, False
        return have, await self._finish(sha)

    async def _finish(self, sha: str) -> bool:
        running = self._hash.pop(sha, None)
        digest = running[0].hexdigest() if running else \
            (await asyncio.to_thread(_hash_prefix, self._p(sha, ".part"), None)).hexdigest()
        part = self._p(sha, ".part")
        if digest != sha:
            part.unlink(missing_ok=True)  # the prefix is wrong somewhere: start over
            raise ProtocolError(f"shard sha256 mismatch (got {digest[:16]}...); partial discarded")
        if not part.exists():
            part.touch()
        os.replace(part, self._p(sha))
        return True

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


def _hash_prefix(path: Path, length: int | None) -> object:
    """sha256 of the first length bytes of path (all if None; none if missing)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            left = length
            while left is None or left > 0:
                block = f.read(4 * 1024 * 1024 if left is None else min(left, 4 * 1024 * 1024))
                if not block:
                    break
                h.update(block)
                if left is not None:
                    left -= len(block)
    except FileNotFoundError:
        pass
    return h
