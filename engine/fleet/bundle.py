"""Shard bundles: one file per exported shard folder, so the agent's
content-addressed, resumable, hash-checked store (shards.py) can carry it.

A bundle is an uncompressed POSIX tar of the folder's regular files, sorted,
with zeroed owners and times: the same shard always gives the same bytes, so
the same sha256, and an agent that has it never receives it again. (IR
weights do not compress much; not compressing keeps packing at disk speed.)

The controller packs once into its cache (`<bundle>.tar` + `<bundle>.sha256`);
the agent unpacks into `<data>/shards/<sha256>.d/` on the first Load. The
controller is paired (trusted), but unpacking still refuses anything but
plain files with plain names: no paths, links, devices or `..`.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

BUNDLE_SUFFIX = ".tar"
MAX_MEMBERS = 64  # a shard is shard.xml/.bin/.json; leave room, refuse floods
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}\Z")


class BundleError(ValueError):
    """Not a shard bundle we are willing to unpack; str(e) says why."""


def pack(folder: Path, out: Path) -> tuple[Path, str]:
    """Pack folder's regular files into out (atomically); (out, sha256)."""
    folder = Path(folder)
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise BundleError(f"{folder} holds no files")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as raw:
            writer = _HashingWriter(raw, h)
            with tarfile.open(fileobj=writer, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for p in files:
                    info = tarfile.TarInfo(p.name)
                    info.size = p.stat().st_size
                    info.mode, info.mtime, info.uid, info.gid = 0o644, 0, 0, 0
                    info.uname = info.gname = ""
                    with open(p, "rb") as f:
                        tar.addfile(info, f)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out, h.hexdigest()


def cached_pack(folder: Path, cache: Path) -> tuple[Path, str]:
    """The bundle of folder in cache (named after the folder, which is the
    shard's content key), packing it on the first call; (path, sha256)."""
    folder = Path(folder)
    out = Path(cache) / f"{folder.name}{BUNDLE_SUFFIX}"
    sha_file = out.with_suffix(".sha256")
    newest = max(p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file())
    if out.exists() and sha_file.exists() and out.stat().st_mtime_ns >= newest:
        sha = sha_file.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{64}", sha):
            return out, sha
    out, sha = pack(folder, out)
    sha_file.write_text(sha + "\n")
    return out, sha


def is_bundle(path: Path) -> bool:
    try:
        return tarfile.is_tarfile(path)
    except OSError:
        return False


def unpack(bundle: Path, target: Path) -> Path:
    """Unpack a bundle into target (atomically: a temp folder renamed into
    place; an existing target is reused). Returns target."""
    target = Path(target)
    if target.is_dir():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with tarfile.open(bundle, mode="r:") as tar:
            members = []
            for m in tar:
                if len(members) >= MAX_MEMBERS:
                    raise BundleError(f"a shard bundle holds at most {MAX_MEMBERS} files")
                if not m.isreg() or not _NAME.match(m.name) or m.name in (".", ".."):
                    raise BundleError(f"refusing bundle member {m.name[:80]!r}: plain files only")
                members.append(m)
            if not members:
                raise BundleError("empty shard bundle")
            for m in members:
                src = tar.extractfile(m)
                assert src is not None
                with src, open(tmp / m.name, "wb") as dst:
                    shutil.copyfileobj(src, dst, 4 * 1024 * 1024)
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.is_dir():  # not a concurrent unpack of the same bundle
                raise
    except tarfile.TarError as e:
        raise BundleError(f"not a shard bundle: {e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes what passes through it."""

    def __init__(self, raw, h) -> None:
        self.raw, self.h, self.pos = raw, h, 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, b) -> int:
        self.h.update(b)
        n = self.raw.write(b)
        self.pos += n
        return n
