"""The expert store: one 4 KiB-aligned blob per (layer, expert) on disk.

Layout of a store folder (written by convert.py):

    index.json          what is where: blob offsets, sizes, checksums, tensor parts
    experts.bin         every expert blob, each at a 4 KiB-aligned offset and
                        padded to a 4 KiB multiple (what O_DIRECT requires)
    rest.safetensors    every non-expert weight (attention, norms, routers,
                        shared experts, embeddings, head); stays resident
    config.json, tokenizer files

A blob holds one expert's gate_up [2I, H] (gate rows first, then up rows: the
transformers 5 `gate_up_proj[e]` layout) followed by down [I->H] as [H, I], in
the checkpoint's own dtype (bf16, fp16 or f32: the bytes it ships, no widening)
or, when asked, int8 with one f32 scale per output row after the two matrices
(`gate_up_scale` [2I], `down_scale` [H]). Every part says its dtype. Reads go straight from the disk into a caller's page-aligned buffer
(a cache slot) unbuffered -- O_DIRECT on Linux, FILE_FLAG_NO_BUFFERING on
Windows, F_NOCACHE on macOS (engine/platform/pread.py) -- so benchmark figures
reflect the disk and not the page cache; where that is not in effect (a file
system that refuses it, or tmpfs/ramfs, whose pages are RAM: recent kernels
accept O_DIRECT there but no read comes from a disk) the store falls back to
buffered reads with a warning and says so: `io_mode` is then "buffered" and
`io_fallback_reason` tells why, so a benchmark can refuse to present
page-cache figures as disk ones. `io_reader` says how reads happen: "preadv"
(os.preadv, no lock) or "seek" (a per-handle lock + seek + readinto: Windows,
which has no pread; FLOTILLA_PORTABLE_IO=1, read when the store opens, forces
it on any OS so the Windows path is tested here). Every blob carries a checksum,
checked on its first read and again after the file changed
(engine/platform/read_checks.py; or on every read, verify="always"), so a
corrupted blob is reported as an error, never turned into a wrong answer.
"""

from __future__ import annotations

import json
import logging
import mmap
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.platform import pread
from engine.platform.direct_io import DirectIOReport, open_for_reads
from engine.platform.read_checks import ReadChecks

log = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT needs offsets, sizes and buffers aligned to the logical block size
INDEX_FILE = "index.json"
BLOB_FILE = "experts.bin"
REST_FILE = "rest.safetensors"
STORE_VERSION = 2  # 2: parts carry their dtype (1 was float32 only)

Key = tuple[int, int]  # (layer, expert)


class StoreError(RuntimeError):
    """The expert store is missing, malformed or corrupted."""


class ChecksumError(StoreError):
    """A blob read back from disk does not match its recorded checksum."""


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


# -- checksums -----------------------------------------------------------------
def _xxh3(data: Any) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(data)


def _crc32(data: Any) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def default_checksum() -> str:
    """xxh3 (~10 GB/s, releases the GIL) when installed, else crc32 (zlib)."""
    try:
        import xxhash  # noqa: F401

        return "xxh3_64"
    except ImportError:
        return "crc32"


CHECKSUMS = {"xxh3_64": _xxh3, "crc32": _crc32}


def checksum(algo: str, data: Any) -> str:
    try:
        return CHECKSUMS[algo](data)
    except KeyError:
        raise StoreError(f"unknown checksum {algo!r} (this store needs: pip install xxhash)") from None


# -- the index -------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    name: str  # "gate_up" [2I, H], "down" [H, I]; int8 stores add "gate_up_scale" [2I], "down_scale" [H]
    shape: tuple[int, ...]  # elements
    offset: int  # bytes from the blob start
    dtype: str = "f32"  # engine.runtime.stored.STORAGE_DTYPES key

    @property
    def nbytes(self) -> int:
        n = ELEMENT_BYTES[self.dtype]
        for d in self.shape:
            n *= int(d)
        return n


ELEMENT_BYTES = {"f32": 4, "bf16": 2, "fp16": 2, "int8": 1}
WEIGHT_DTYPES = ("bf16", "fp16", "f32", "int8")


def blob_parts(inter: int, hidden: int, dtype: str) -> tuple[tuple[Part, ...], int]:
    """The parts of one expert blob and its unpadded size: gate_up, down (in `dtype`), then
    for int8 the f32 row scales, each part starting 64-byte aligned."""
    if dtype not in ELEMENT_BYTES:
        raise StoreError(f"unsupported expert dtype {dtype!r}; choose one of {', '.join(WEIGHT_DTYPES)}")
    specs = [("gate_up", (2 * inter, hidden), dtype), ("down", (hidden, inter), dtype)]
    if dtype == "int8":
        specs += [("gate_up_scale", (2 * inter,), "f32"), ("down_scale", (hidden,), "f32")]
    parts, offset = [], 0
    for name, shape, dt in specs:
        part = Part(name, shape, offset, dt)
        parts.append(part)
        offset = align_up(offset + part.nbytes, 64)
    return tuple(parts), parts[-1].offset + parts[-1].nbytes


@dataclass(frozen=True)
class BlobInfo:
    offset: int  # bytes from the start of experts.bin (4 KiB-aligned)
    checksum: str  # hex digest of the blob's padded bytes


@dataclass(frozen=True)
class StoreIndex:
    model_type: str  # config model_type, e.g. "mixtral"
    num_layers: int  # decoder layers of the model
    moe_layers: tuple[int, ...]  # layers that have routed experts
    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts per token
    hidden: int  # H
    intermediate: int  # I, one expert's FFN width
    blob_bytes: int  # padded bytes of one blob (all blobs are alike)
    data_bytes: int  # unpadded bytes of one blob
    parts: tuple[Part, ...]  # tensors inside a blob
    checksum_algo: str  # "xxh3_64" or "crc32"
    blobs: dict[Key, BlobInfo]  # (layer, expert) -> where and what
    source: str  # fingerprint of the checkpoint it was converted from
    dtype: str = "f32"  # the experts' weight dtype (WEIGHT_DTYPES); "int8" when quantized
    source_dtype: str = "f32"  # the checkpoint's expert dtype

    def to_json(self) -> dict[str, Any]:
        return {
            "version": STORE_VERSION, "model_type": self.model_type, "num_layers": self.num_layers,
            "moe_layers": list(self.moe_layers), "num_experts": self.num_experts, "top_k": self.top_k,
            "hidden": self.hidden, "intermediate": self.intermediate, "blob_bytes": self.blob_bytes,
            "data_bytes": self.data_bytes, "checksum_algo": self.checksum_algo, "source": self.source,
            "dtype": self.dtype, "source_dtype": self.source_dtype,
            "parts": [{"name": p.name, "shape": list(p.shape), "offset": p.offset, "dtype": p.dtype}
                      for p in self.parts],
            "blobs": {f"{k[0]}.{k[1]}": {"offset": b.offset, "checksum": b.checksum}
                      for k, b in sorted(self.blobs.items())},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "StoreIndex":
        if d.get("version") != STORE_VERSION:
            raise StoreError(f"expert store version {d.get('version')} is not supported "
                             f"(expected {STORE_VERSION}); delete the store and it will be rebuilt")
        try:
            blobs = {}
            for k, b in d["blobs"].items():
                layer, expert = (int(x) for x in k.split("."))
                blobs[(layer, expert)] = BlobInfo(int(b["offset"]), str(b["checksum"]))
            return cls(
                model_type=str(d["model_type"]), num_layers=int(d["num_layers"]),
                moe_layers=tuple(int(i) for i in d["moe_layers"]), num_experts=int(d["num_experts"]),
                top_k=int(d["top_k"]), hidden=int(d["hidden"]), intermediate=int(d["intermediate"]),
                blob_bytes=int(d["blob_bytes"]), data_bytes=int(d["data_bytes"]),
                parts=tuple(Part(p["name"], tuple(p["shape"]), int(p["offset"]), str(p["dtype"]))
                            for p in d["parts"]),
                checksum_algo=str(d["checksum_algo"]), blobs=blobs, source=str(d.get("source", "")),
                dtype=str(d["dtype"]), source_dtype=str(d["source_dtype"]))
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"malformed expert store index: {e}") from None

    @property
    def total_expert_bytes(self) -> int:
        return self.blob_bytes * len(self.blobs)


@dataclass(frozen=True)
class StoreConfig:
    direct: bool = True  # unbuffered reads (bypass the page cache: O_DIRECT & co.); falls back with a warning
    verify: str = "first"  # checksum: "first" read of each blob and again once the file changed
    #                        (engine/platform/read_checks.py), "always" (every read), "never"


class ExpertStore(DirectIOReport):
    """Reads expert blobs into caller-owned aligned buffers; thread-safe (engine.platform.pread)."""

    def __init__(self, folder: Path, config: StoreConfig = StoreConfig()) -> None:
        self.folder = Path(folder)
        self.config = config
        try:
            raw = json.loads((self.folder / INDEX_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise StoreError(f"cannot read the expert store index in {self.folder}: {e}") from None
        self.index = StoreIndex.from_json(raw)
        path = self.folder / BLOB_FILE
        expect = max((b.offset for b in self.index.blobs.values()), default=0) + self.index.blob_bytes
        try:
            size = path.stat().st_size
        except OSError as e:
            raise StoreError(f"expert blobs missing: {e}") from None
        if size < expect:
            raise StoreError(f"{path} is truncated ({size} bytes, the index needs {expect})")
        self.direct = False  # unbuffered reads in effect (see io_mode / io_fallback_reason)
        self.io_fallback_reason: str | None = None
        self._reader = self._open(path)
        self._slot = {key: i for i, key in enumerate(sorted(self.index.blobs))}  # blob -> index for checks
        self._checks = ReadChecks(config.verify, [len(self._slot)])
        self._lock = threading.Lock()
        self.bytes_read = 0  # total bytes read from disk (statistics)
        self.reads = 0  # blobs read
        self.checksums = 0  # blobs checksummed

    def _open(self, path: Path) -> pread.Reader:
        self.io_unbuffered = pread.unbuffered_mode()
        reader = open_for_reads(path, self.config.direct)
        self.io_fallback_reason, self.io_reader = reader.fallback_reason, reader.method
        self.direct = self.config.direct and self.io_fallback_reason is None
        if self.io_fallback_reason:
            log.warning("%s is not in effect for %s (%s); using buffered reads, so figures "
                        "include the page cache", pread.LABELS[self.io_unbuffered], path, self.io_fallback_reason)
        return reader

    @property
    def keys(self) -> list[Key]:
        return sorted(self.index.blobs)

    def read_into(self, key: Key, buf: mmap.mmap) -> None:
        """Read blob `key` into `buf` (aligned, >= blob_bytes) and verify it.

        Raises ChecksumError if the bytes do not match the index; the caller
        must then not use the buffer."""
        try:
            info = self.index.blobs[key]
        except KeyError:
            raise StoreError(f"no expert {key[1]} in layer {key[0]} in {self.folder}") from None
        n = self.index.blob_bytes
        view = memoryview(buf)[:n]
        try:
            self._reader.readinto(view, info.offset)  # short reads resumed (at aligned offsets)
        except pread.ShortReadError:
            raise StoreError(f"short read of expert {key} from {self.folder / BLOB_FILE}") from None
        slot = np.array([self._slot[key]])
        need, token = self._checks.needed(0, self._reader.fd, slot)
        with self._lock:
            self.bytes_read += n
            self.reads += 1
            self.checksums += int(need[0])
        if need[0]:
            digest = checksum(self.index.checksum_algo, view)
            if digest != info.checksum:
                raise ChecksumError(
                    f"expert {key[1]} of layer {key[0]} is corrupted in {self.folder / BLOB_FILE} "
                    f"(checksum {digest} != {info.checksum}); re-convert the model "
                    f"(delete {self.folder})")
            self._checks.passed(0, slot, token)

    def close(self) -> None:
        self._reader.close()
