"""BundleView: a shard folder's bundle made on the fly is byte for byte the tar Python's
tarfile writes for the same members, reads correctly at any offset (resumed sends), and is
what the agent's StreamUnpacker accepts -- so the controller never writes the archive."""

from __future__ import annotations

import hashlib
import io
import os
import random
import tarfile
from pathlib import Path

import pytest

from engine.fleet import bundle
from engine.fleet.bundle_view import BundleView, BundleViewError


def _folder(tmp_path: Path, sizes: dict[str, int]) -> Path:
    d = tmp_path / "shard"
    d.mkdir()
    rng = random.Random(7)
    for name, n in sizes.items():
        (d / name).write_bytes(rng.randbytes(n))
    (d / ".tmp-ignored").write_bytes(b"hidden files are not part of a bundle")
    return d


def _tarfile_bytes(folder: Path) -> bytes:
    """The reference: the stdlib writing the bundle's members (sorted, zeroed owners/times, PAX)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(q for q in folder.iterdir() if q.is_file() and not q.name.startswith(".")):
            info = tarfile.TarInfo(p.name)
            info.size = p.stat().st_size
            info.mode, info.mtime, info.uid, info.gid = 0o644, 0, 0, 0
            info.uname = info.gname = ""
            with open(p, "rb") as f:
                tar.addfile(info, f)
    return buf.getvalue()


# sizes around the 512-byte block and 10 KiB record edges, an empty file, a long name (pax)
SIZES = {"openvino_model.bin": 70_001, "openvino_model.xml": 512, "manifest.json": 0,
         "a" * 120 + ".json": 10_240 - 1024, "tokenizer.json": 1}


def test_view_bytes_equal_the_tarfile_bundle(tmp_path):
    d = _folder(tmp_path, SIZES)
    want = _tarfile_bytes(d)
    view = BundleView(d)
    assert view.size == len(want)
    with view.open() as f:
        assert f.read() == want
    assert view.sha256() == hashlib.sha256(want).hexdigest()
    out, sha = bundle.pack(d, tmp_path / "b.tar")  # the file form, for tools and tests
    assert out.read_bytes() == want and sha == view.sha256()


def test_reads_at_any_offset_as_a_resumed_send_does(tmp_path):
    d = _folder(tmp_path, SIZES)
    want = _tarfile_bytes(d)
    view = BundleView(d)
    rng = random.Random(3)
    with view.open() as f:
        for _ in range(300):
            off, n = rng.randrange(0, view.size + 10), rng.choice([1, 7, 511, 512, 513, 4096, 70_000])
            f.seek(off)
            assert f.read(n) == want[off:off + n], (off, n)
        f.seek(-5, os.SEEK_END)
        assert f.read() == want[-5:]


def test_the_agents_unpacker_accepts_the_view(tmp_path):
    d = _folder(tmp_path, SIZES)
    u = bundle.StreamUnpacker()
    files: dict[str, bytearray] = {}
    with BundleView(d).open() as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        name, n = u.want()
        piece = data[pos:pos + max(1, min(n, 999))]
        took = u.take(piece) if name is None else None
        if name is not None:
            files.setdefault(name, bytearray()).extend(piece)
            u.take(piece)
        elif took:
            files.setdefault(took, bytearray())
        pos += len(piece)
    u.finish()
    for name, n in SIZES.items():
        assert bytes(files.get(name, b"")) == (d / name).read_bytes(), name


def test_an_empty_folder_is_refused(tmp_path):
    (tmp_path / "e").mkdir()
    with pytest.raises(BundleViewError, match="no files"):
        BundleView(tmp_path / "e")
    with pytest.raises(bundle.BundleError, match="no files"):
        bundle.cached_bundle(tmp_path / "e", tmp_path / "cache")


def test_a_file_that_shrinks_under_the_view_is_an_error_not_a_corrupt_send(tmp_path):
    d = _folder(tmp_path, {"openvino_model.bin": 50_000})
    view = BundleView(d)
    (d / "openvino_model.bin").write_bytes(b"short")
    with view.open() as f, pytest.raises(BundleViewError, match="changed"):
        f.read()
