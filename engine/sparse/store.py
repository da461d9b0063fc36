"""The neuron-bundle store: every FFN neuron's weights together on disk.

One file per FFN layer holds N bundles; bundle i is the neuron's gate row, up
row and down column (each h values in the checkpoint's dtype: f32, f16 or
bf16 -- a 16-bit checkpoint gives half-size bundles), padded to a multiple of 4 KiB
(`stride`) so that any run of bundles is an aligned O_DIRECT read. In "exact"
mode the gate stays resident and the bundles hold only up + down, so the
bytes streamed per neuron shrink by a third.

    <store>/meta.json          layout, parts, stride, file sizes
    <store>/sums.npy           uint64 [L, N]: xxh3-64 of each bundle's payload
    <store>/layer-007.bin      N x stride bytes

A bundle read from disk is checked against its xxh3-64 checksum on its first
read and again on every read once its file changed (engine/platform/read_checks.py;
verify="always": every read), so a damaged file raises CorruptStoreError instead
of silently computing with garbage. read_into() lands bundles straight in the
neuron cache's slots (scatter reads, no copy); read_async() uses a buffer. Reads of sorted neuron ids are coalesced into ranges (runs of
consecutive bundles; gaps read through only when the disk probe says reading
them is cheaper than one more request) and submitted as one batch through
Linux native AIO (aio.py: one io_submit for the whole batch, the full queue
depth at the device, no per-read Python). Where AIO is unavailable (not
Linux, or FLOTILLA_PORTABLE_IO=1), a thread pool issues the reads through the
portable reader of engine/platform/pread.py: os.preadv where it exists, a
per-file lock + seek + readinto on Windows -- and on any OS with
FLOTILLA_PORTABLE_IO=1 (read when the store opens), so this suite runs the
Windows path. `io_reader` says which: "aio", "preadv", "pread" or "seek".

Files are opened unbuffered (config.direct: O_DIRECT on Linux,
FILE_FLAG_NO_BUFFERING on Windows, F_NOCACHE on macOS) when it is really in
effect; otherwise (a file system refusing it, tmpfs/ramfs whose pages are RAM)
the store falls back to buffered reads with a warning, and `io_mode` /
`io_fallback_reason` say so (benchmarks record both and refuse to report
speedups measured through the page cache).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import xxhash

from engine.models.errors import ModelError
from engine.platform.direct_io import DirectIOReport, open_for_reads  # the one unbuffered probe (tmpfs, EINVAL, flag check)
from engine.platform import pread
from engine.platform.read_checks import ReadChecks
from engine.sparse import aio
from engine.sparse.weights import FFNLayout, MappedWeights

log = logging.getLogger(__name__)

STORE_VERSION = 3
DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}  # bf16 kept as raw 16-bit words
ST_TO_STORE = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
ALIGN = 4096  # bytes: O_DIRECT and page alignment of every bundle
PARTS = {"full": ("gate", "up", "down"), "exact": ("up", "down")}


class CorruptStoreError(ModelError):
    """A bundle file does not match its checksums (or its expected size)."""


@dataclass(frozen=True)
class StoreConfig:
    threads: int = 8  # thread-pool fallback only (no native AIO): parallel reads (serialised per file by "seek")
    depth: int = 256  # AIO: reads in flight at most (the device queue; diskprobe measures the gain)
    max_gap: int = 0  # read through gaps of up to this many unneeded bundles. 0 by default: measured
    #                   here (diskprobe), one more 8-16 KiB request at depth 64 costs ~20 us while
    #                   streaming one more 16 KiB bundle costs ~18 us, so gaps are not worth reading
    max_request: int = 256 * 1024  # bytes per read at most (bigger gains nothing: probe)
    direct: bool = True  # unbuffered (O_DIRECT & co.): bypass the page cache so RAM use is only our cache
    verify: str = "first"  # checksum (xxh3-64) each bundle's "first" read and again after its file
    #                        changed (engine/platform/read_checks.py), "always" (every read), "never"
    aio: bool = True  # batched Linux AIO when available and not FLOTILLA_PORTABLE_IO (else the thread pool)


@dataclass
class IOStats:
    bytes_read: int = 0  # from disk, padding included
    reads: int = 0  # read requests (AIO iocbs or reader calls)
    bundles: int = 0  # bundles delivered
    seconds: float = 0.0  # thread pool: summed busy time; AIO: wall time from submit to completion
    verify_s: float = 0.0  # checksum checking
    checked: int = 0  # bundles checksummed
    submit_s: float = 0.0  # AIO: time inside io_submit (blocks while the device queue is full: I/O wait too)

    def snapshot(self) -> dict:
        return asdict(self)


def bundle_payload(parts: tuple[str, ...], hidden: int, itemsize: int = 4) -> int:
    return len(parts) * hidden * itemsize


def checkpoint_dtype(weights: MappedWeights, layout: FFNLayout) -> str:
    """The store dtype that keeps the FFN weights bit for bit: f32, f16 or bf16."""
    st = weights.dtype_of(layout.key(0, "up"))
    if st not in ST_TO_STORE:
        raise ModelError(f"FFN weights of dtype {st} are not supported by the sparse engine (F32, F16, BF16)")
    return ST_TO_STORE[st]


def build_store(weights: MappedWeights, layout: FFNLayout, out: Path, mode: str = "full",
                progress=None, dtype: str | None = None) -> Path:
    """Write the bundles of every FFN layer into `out` (atomically: a temp
    folder renamed into place). dtype None = the checkpoint's (lossless)."""
    parts = PARTS[mode]
    dtype = dtype or checkpoint_dtype(weights, layout)
    if dtype != checkpoint_dtype(weights, layout):
        raise ValueError(f"store dtype {dtype} differs from the checkpoint's; the store is always lossless")
    npdt = np.dtype(DTYPES[dtype])
    payload = bundle_payload(parts, layout.hidden, npdt.itemsize)
    stride = -(-payload // ALIGN) * ALIGN
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".store-", dir=out.parent))
    try:
        crcs = np.zeros((layout.num_layers, layout.neurons), dtype=np.uint64)
        for layer in range(layout.num_layers):
            if progress:
                progress(f"writing neuron bundles of layer {layer + 1}/{layout.num_layers}",
                         layer / layout.num_layers)
            mats = {"gate": weights.raw(layout.key(layer, "gate")),  # [N, h]
                    "up": weights.raw(layout.key(layer, "up")),  # [N, h]
                    "down": weights.raw(layout.key(layer, "down")).T}  # [h, N] -> [N, h]
            buf = np.zeros((layout.neurons, stride), dtype=np.uint8)  # [N, stride]
            body = np.stack([np.asarray(mats[p]).view(npdt) for p in parts], axis=1)  # [N, P, h]
            buf[:, :payload] = body.reshape(layout.neurons, -1).view(np.uint8)
            for i in range(layout.neurons):
                crcs[layer, i] = xxhash.xxh3_64_intdigest(buf[i, :payload])
            with open(tmp / f"layer-{layer:03d}.bin", "wb") as f:
                f.write(buf.data)
                f.flush()
                os.fsync(f.fileno())  # on disk before the folder is renamed into place
                if hasattr(os, "posix_fadvise"):  # and out of the page cache: reads bypass it anyway
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            del buf, body
        np.save(tmp / "sums.npy", crcs)
        meta = {"version": STORE_VERSION, "mode": mode, "parts": list(parts), "stride": stride, "dtype": dtype,
                "payload": payload, "layout": asdict(layout),
                "crc_of_index": zlib.crc32(crcs.tobytes())}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def coalesce(ids: np.ndarray, max_gap: int, max_run: int) -> list[tuple[int, int]]:
    """Sorted unique ids -> half-open bundle ranges [start, end) covering them."""
    if len(ids) == 0:
        return []
    breaks = np.nonzero(np.diff(ids) > max_gap + 1)[0]
    starts = np.concatenate(([ids[0]], ids[breaks + 1]))
    ends = np.concatenate((ids[breaks] + 1, [ids[-1] + 1]))
    out: list[tuple[int, int]] = []
    for s, e in zip(starts.tolist(), ends.tolist()):
        while e - s > max_run:
            out.append((s, s + max_run))
            s += max_run
        out.append((s, e))
    return out


class PendingRead:
    """Bundles of one layer being read; result() -> (ids, rows [k, P, h]) in the store dtype.

    AIO: one buffer for the whole batch, one io_submit; result() reaps the
    completions, checks the checksum of each needed bundle and returns a view
    (no copy) of the needed rows. Thread pool: one future per range."""

    def __init__(self, store: "BundleStore", layer: int, ids: np.ndarray, ranges: list[tuple[int, int]]) -> None:
        self.store, self.layer, self.ids, self.ranges = store, layer, ids, ranges
        self._batch = None
        self._futures = None
        self._t0 = time.perf_counter()
        self._out: tuple[np.ndarray, np.ndarray] | None = None
        if not ranges:
            return
        st = store.stride
        starts = np.array([r[0] for r in ranges], dtype=np.int64)
        counts = np.array([r[1] - r[0] for r in ranges], dtype=np.int64)
        self._starts, self._counts = starts, counts
        if store._ring is not None:
            first = np.concatenate(([0], np.cumsum(counts)[:-1]))  # buffer row of each range
            self._first = first
            self._buf = aio.aligned_empty(int(counts.sum()) * st)
            t0 = time.perf_counter()
            with store._ring_lock:
                self._batch = store._ring.submit(np.full(len(ranges), store._fds[layer], dtype=np.uint32),
                                                 starts * st, counts * st,
                                                 self._buf.ctypes.data + first * st, keep=self._buf)
            with store._stats_lock:
                store.stats.submit_s += time.perf_counter() - t0
        else:
            self._futures = [store._pool.submit(store._read_range, layer, s, e) for s, e in ranges]

    def done(self) -> bool:
        if self._out is not None or not self.ranges:
            return True
        if self._batch is not None:
            with self.store._ring_lock:
                return self.store._ring.done(self._batch)
        return all(f.done() for f in self._futures)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        if self._out is not None:
            return self._out
        store = self.store
        if not self.ranges:
            self._out = (self.ids, np.empty((0,) + store.row_shape, dtype=store.np_dtype))
            return self._out
        if self._batch is not None:
            try:
                with store._ring_lock:
                    store._ring.wait(self._batch)
            except aio.AIOError as e:
                raise CorruptStoreError(f"{store.file(self.layer)}: a read failed ({e}); the store file is "
                                        f"damaged or truncated -- delete {store.path} to rebuild it") from None
            wall = time.perf_counter() - self._t0
            block = self._buf.reshape(-1, store.stride)  # [rows read, stride]
            # buffer row of every needed id: the range that covers it, then the offset inside
            which = np.searchsorted(self._starts, self.ids, side="right") - 1
            pos = self._first[which] + (self.ids - self._starts[which])
            payload = block[pos, :store.payload] if len(pos) != len(block) else block[:, :store.payload]
            store._verify(self.layer, self.ids, payload)
            rows = payload.view(store.np_dtype).reshape((len(self.ids),) + store.row_shape)
            with store._stats_lock:
                store.stats.bytes_read += block.nbytes
                store.stats.reads += len(self.ranges)
                store.stats.bundles += len(self.ids)
                store.stats.seconds += wall
            self._out = (self.ids, rows)
            self._buf = None
            return self._out
        rows = np.empty((len(self.ids),) + store.row_shape, dtype=store.np_dtype)  # [k, P, h]
        which = np.searchsorted(self._starts, self.ids, side="right") - 1
        for j, fut in enumerate(self._futures):
            block = fut.result()  # [e - s, P, h]
            sel = which == j
            rows[sel] = block[self.ids[sel] - self._starts[j]]
        self._out = (self.ids, rows)
        return self._out


class DirectRead:
    """Bundles read straight into caller-owned slots (no copy); wait() checks them."""

    def __init__(self, store: "BundleStore", layer: int, ids: np.ndarray, addrs: np.ndarray,
                 rows: np.ndarray) -> None:
        self.store, self.layer, self.ids, self.rows = store, layer, ids, rows
        self._t0 = time.perf_counter()
        self._done = len(ids) == 0
        self._batch = None
        self._bytes = 0
        if self._done:
            return
        st = store.stride
        ranges = coalesce(ids, store.config.max_gap, store.max_run)
        starts = np.array([r[0] for r in ranges], dtype=np.int64)
        ends = np.array([r[1] for r in ranges], dtype=np.int64)
        # one iovec per bundle of every range: the id's slot, or scratch for a gap bundle
        span = np.arange(int((ends - starts).sum())) - np.repeat(np.cumsum(ends - starts) - (ends - starts),
                                                                  ends - starts)
        bundle = np.repeat(starts, ends - starts) + span  # bundle index of every iovec
        pos = np.searchsorted(ids, bundle)
        hit = (pos < len(ids)) & (ids[np.minimum(pos, len(ids) - 1)] == bundle)
        if not hit.all():
            self._scratch = aio.aligned_empty(st)
        iov = np.zeros(len(bundle), dtype=aio.IOVEC)
        iov["len"] = st
        iov["base"] = np.where(hit, addrs[np.minimum(pos, len(ids) - 1)],
                               np.uint64(self._scratch.ctypes.data) if not hit.all() else np.uint64(0))
        self._iov = iov
        first = np.concatenate(([0], np.cumsum(ends - starts)[:-1]))
        self._bytes = len(bundle) * st
        self._nreads = len(ranges)
        if store._ring is not None:
            t0 = time.perf_counter()
            with store._ring_lock:
                self._batch = store._ring.submit(
                    np.full(len(ranges), store._fds[layer], dtype=np.uint32), starts * st, ends - starts,
                    iov.ctypes.data + first * aio.IOVEC.itemsize, keep=iov, vectored=True,
                    expect=(ends - starts) * st)
            with store._stats_lock:
                store.stats.submit_s += time.perf_counter() - t0
        else:  # thread pool: the portable reader scatters too
            self._futures = []
            for s, e, f in zip(starts.tolist(), ends.tolist(), first.tolist()):
                self._futures.append(store._pool.submit(self._scatter, s, e, f))

    def _scatter(self, s: int, e: int, f: int) -> None:
        """Bundles [s, e) into their slots (iovecs f..): one scatter read; ShortReadError is an OSError."""
        st = self.store.stride
        bufs = [ctypes_buffer(int(a), st) for a in self._iov["base"][f:f + e - s]]
        self.store._readers[self.layer].readv_into(bufs, s * st)

    def wait(self) -> None:
        if self._done:
            return
        store = self.store
        try:
            if self._batch is not None:
                with store._ring_lock:
                    store._ring.wait(self._batch)
            else:
                for f in self._futures:
                    f.result()
        except OSError as e:
            raise CorruptStoreError(f"{store.file(self.layer)}: a read failed ({e}); the store file is "
                                    f"damaged or truncated -- delete {store.path} to rebuild it") from None
        self._done = True
        wall = time.perf_counter() - self._t0
        store._verify(self.layer, self.ids, self.rows)
        with store._stats_lock:
            store.stats.bytes_read += self._bytes
            store.stats.reads += self._nreads
            store.stats.bundles += len(self.ids)
            store.stats.seconds += wall


def ctypes_buffer(addr: int, n: int):
    import ctypes

    return (ctypes.c_char * n).from_address(addr)


class BundleStore(DirectIOReport):
    """Read-only access to a built store."""

    def __init__(self, path: Path, config: StoreConfig = StoreConfig()) -> None:
        self.path = Path(path)
        self.config = config
        self._readers: list[pread.Reader] = []  # one per layer file
        self._fds: list[int] = []  # their fds, for AIO
        self._ring = None
        self._pool = None
        try:
            meta = json.loads((self.path / "meta.json").read_text())
            self.crc = np.load(self.path / "sums.npy")
        except (OSError, ValueError) as e:
            raise CorruptStoreError(f"the neuron store at {self.path} is unreadable ({e}); "
                                    "delete the folder to rebuild it") from None
        if meta.get("version") != STORE_VERSION:
            raise CorruptStoreError(f"the neuron store at {self.path} has version {meta.get('version')}; "
                                    "delete the folder to rebuild it")
        if zlib.crc32(self.crc.tobytes()) != meta["crc_of_index"]:
            raise CorruptStoreError(f"the checksum index of {self.path} is damaged; delete the folder to rebuild it")
        self.layout = FFNLayout(**meta["layout"])
        self.mode: str = meta["mode"]
        self.parts: tuple[str, ...] = tuple(meta["parts"])
        self.stride: int = meta["stride"]
        self.payload: int = meta["payload"]
        self.dtype: str = meta["dtype"]
        self.np_dtype = np.dtype(DTYPES[self.dtype])
        self.row_shape = (len(self.parts), self.layout.hidden)  # one bundle: [P, h]
        self.stats = IOStats()
        self.checks = ReadChecks(config.verify, [self.layout.neurons] * self.layout.num_layers)
        self._stats_lock = threading.Lock()
        self._ring_lock = threading.Lock()
        self.io_fallback_reason: str | None = None  # why unbuffered reads are not in effect (first file that refused)
        self.io_unbuffered = pread.unbuffered_mode()
        self.portable = pread.portable_forced()  # FLOTILLA_PORTABLE_IO: the path Windows takes (no AIO, "seek")
        for layer in range(self.layout.num_layers):
            f = self.file(layer)
            want = self.layout.neurons * self.stride
            if not f.exists() or f.stat().st_size != want:
                self.close()
                raise CorruptStoreError(f"{f} is missing or has the wrong size (want {want} bytes); "
                                        "delete the store folder to rebuild it")
            self._readers.append(self._open(f))
            self._fds.append(self._readers[-1].fd)
        if self.io_fallback_reason:
            log.warning("%s is not in effect for the neuron store %s (%s); using buffered reads, so "
                        "figures include the page cache", pread.LABELS[self.io_unbuffered], self.path,
                        self.io_fallback_reason)
        if config.aio and not self.portable and aio.available():
            try:
                self._ring = aio.Ring(config.depth)
            except OSError:
                self._ring = None
        if self._ring is None:
            self._pool = ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="flotilla-sparse-io")
        self.io_reader = "aio" if self._ring is not None else self._readers[0].method if self._readers else "preadv"

    def file(self, layer: int) -> Path:
        return self.path / f"layer-{layer:03d}.bin"

    def _open(self, f: Path) -> pread.Reader:
        reader = open_for_reads(f, self.config.direct, portable=self.portable)
        if reader.fallback_reason and self.io_fallback_reason is None:
            self.io_fallback_reason = reader.fallback_reason
        return reader

    @property
    def bundle_floats(self) -> int:
        return self.row_shape[0] * self.row_shape[1]

    @property
    def row_bytes(self) -> int:
        """One bundle in RAM (no padding)."""
        return self.bundle_floats * self.np_dtype.itemsize

    @property
    def cache_slot_bytes(self) -> int:
        """RAM per cached bundle: the 4 KiB-aligned stride when padding wastes at most a
        quarter (then reads land straight in the cache's slots), else the bare payload
        (tiny bundles: read into a buffer and copied)."""
        return self.stride if (self.stride - self.payload) * 4 <= self.stride else self.row_bytes

    @property
    def max_run(self) -> int:
        return max(1, self.config.max_request // self.stride)

    # -- reads ------------------------------------------------------------------------
    def read_async(self, layer: int, ids: np.ndarray) -> PendingRead:
        """Start reading the bundles of sorted unique `ids`; returns at once."""
        ids = np.asarray(ids, dtype=np.int64)
        return PendingRead(self, layer, ids, coalesce(ids, self.config.max_gap, self.max_run))

    def read(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """Read bundles now: rows [k, P, h] in the order of sorted `ids`."""
        return self.read_async(layer, ids).result()[1]

    def _verify(self, layer: int, ids: np.ndarray, payload: np.ndarray) -> None:
        """payload [k, payload bytes] of bundles ids, just read: the xxh3-64 checksum of every
        one that needs checking (self.checks) must match."""
        t0 = time.perf_counter()
        need, token = self.checks.needed(layer, self._fds[layer], ids)
        todo = np.flatnonzero(need)
        if len(todo) == 0:
            return
        want = self.crc[layer, ids[todo]].tolist()
        digest = xxhash.xxh3_64_intdigest
        for j, w in zip(todo.tolist(), want):
            if digest(payload[j]) != w:
                raise CorruptStoreError(
                    f"{self.file(layer)}: neuron {int(ids[j])} fails its checksum; the store is damaged "
                    f"-- delete {self.path} to rebuild it from the model")
        self.checks.passed(layer, ids[todo], token)
        with self._stats_lock:
            self.stats.verify_s += time.perf_counter() - t0
            self.stats.checked += len(todo)

    def _read_range(self, layer: int, start: int, end: int) -> np.ndarray:
        """Thread-pool path: one read of bundles [start, end) through the layer's reader."""
        t0 = time.perf_counter()
        n = (end - start) * self.stride
        buf = aio.aligned_empty(n)  # unbuffered reads want an aligned buffer
        try:
            self._readers[layer].readinto(buf, start * self.stride)
        except pread.ShortReadError as e:
            raise CorruptStoreError(f"{self.file(layer)}: short read at bundle {start} ({e.got} of {n} bytes)") from None
        block = buf.reshape(end - start, self.stride)[:, :self.payload]  # [k, payload]
        self._verify(layer, np.arange(start, end), block)
        out = block.view(self.np_dtype).reshape((end - start,) + self.row_shape)  # [k, P, h]
        with self._stats_lock:
            self.stats.bytes_read += n
            self.stats.reads += 1
            self.stats.bundles += end - start
            self.stats.seconds += time.perf_counter() - t0
        return out

    def read_into(self, layer: int, ids: np.ndarray, addrs: np.ndarray, rows: np.ndarray) -> "DirectRead":
        """Start reading the bundles of sorted unique `ids` straight into RAM slots at
        `addrs` (each `stride` bytes, 4 KiB aligned: the neuron cache's slots); `rows`
        [k, payload bytes] views them for the checksum check. Runs of consecutive ids
        become one scatter read (preadv / AIO); gaps are read into a scratch page."""
        return DirectRead(self, layer, np.asarray(ids, dtype=np.int64), np.asarray(addrs, dtype=np.uint64), rows)

    def verify_all(self) -> None:
        """Check every bundle of every layer (raises CorruptStoreError; verify="never": reads only)."""
        self.checks.forget()
        ids = np.arange(self.layout.neurons)
        for layer in range(self.layout.num_layers):
            self.read(layer, ids)

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
            self._pool = None
        ring = getattr(self, "_ring", None)
        if ring is not None:
            with self._ring_lock:
                ring.close()
            self._ring = None
        for reader in getattr(self, "_readers", []):
            reader.close()
        self._readers, self._fds = [], []
