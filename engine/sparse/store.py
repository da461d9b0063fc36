"""The neuron-bundle store: every FFN neuron's weights together on disk.

One file per FFN layer holds N bundles; bundle i is the neuron's gate row, up
row and down column (each h float32 values), padded to a multiple of 4 KiB
(`stride`) so that any run of bundles is an aligned O_DIRECT read. In "exact"
mode the gate stays resident and the bundles hold only up + down, so the
bytes streamed per neuron shrink by a third.

    <store>/meta.json          layout, parts, stride, file sizes
    <store>/crc.npy            uint32 [L, N]: crc32 of each bundle's payload
    <store>/layer-007.bin      N x stride bytes

Every bundle read from disk is checked against its crc32 (in the I/O thread),
so a damaged file raises CorruptStoreError instead of silently computing
with garbage. Reads of sorted neuron ids are coalesced into ranges (runs of
consecutive bundles, small gaps read through) and issued in parallel from a
thread pool; os.preadv releases the GIL and so does zlib.crc32.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine.models.errors import ModelError
from engine.sparse.weights import FFNLayout, MappedWeights

STORE_VERSION = 1
ALIGN = 4096  # bytes: O_DIRECT and page alignment of every bundle
PARTS = {"full": ("gate", "up", "down"), "exact": ("up", "down")}


class CorruptStoreError(ModelError):
    """A bundle file does not match its checksums (or its expected size)."""


@dataclass(frozen=True)
class StoreConfig:
    threads: int = 8  # parallel reads in flight (NVMe wants depth; 2 cores still benefit: I/O waits)
    max_gap: int = 8  # read through gaps of up to this many unneeded bundles (one I/O instead of two:
    #                   measured here, a 4 KiB I/O costs ~60 us while 8 bundles stream in ~40 us)
    max_run: int = 64  # bundles per read at most, so big ranges still spread over the pool
    direct: bool = True  # O_DIRECT: bypass the page cache so RAM use is only our cache
    verify: bool = True  # crc32 every bundle read


@dataclass
class IOStats:
    bytes_read: int = 0  # from disk, padding included
    reads: int = 0  # preadv calls
    bundles: int = 0  # bundles delivered
    seconds: float = 0.0  # summed over threads (busy time, not wall time)

    def snapshot(self) -> dict:
        return asdict(self)


def bundle_payload(parts: tuple[str, ...], hidden: int) -> int:
    return len(parts) * hidden * 4


def build_store(weights: MappedWeights, layout: FFNLayout, out: Path, mode: str = "full",
                progress=None) -> Path:
    """Write the bundles of every FFN layer into `out` (atomically: a temp
    folder renamed into place)."""
    parts = PARTS[mode]
    payload = bundle_payload(parts, layout.hidden)
    stride = -(-payload // ALIGN) * ALIGN
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".store-", dir=out.parent))
    try:
        crcs = np.zeros((layout.num_layers, layout.neurons), dtype=np.uint32)
        for layer in range(layout.num_layers):
            if progress:
                progress(f"writing neuron bundles of layer {layer + 1}/{layout.num_layers}",
                         layer / layout.num_layers)
            mats = {"gate": weights.numpy(layout.key(layer, "gate")),  # [N, h]
                    "up": weights.numpy(layout.key(layer, "up")),  # [N, h]
                    "down": weights.numpy(layout.key(layer, "down")).T}  # [h, N] -> [N, h]
            buf = np.zeros((layout.neurons, stride), dtype=np.uint8)  # [N, stride]
            body = np.stack([np.asarray(mats[p], dtype=np.float32) for p in parts], axis=1)  # [N, P, h]
            buf[:, :payload] = body.reshape(layout.neurons, -1).view(np.uint8)
            for i in range(layout.neurons):
                crcs[layer, i] = zlib.crc32(buf[i, :payload])
            buf.tofile(tmp / f"layer-{layer:03d}.bin")
        np.save(tmp / "crc.npy", crcs)
        meta = {"version": STORE_VERSION, "mode": mode, "parts": list(parts), "stride": stride,
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
    """Bundles of one layer being read; result() -> (ids, rows [k, P, h])."""

    def __init__(self, layer: int, ids: np.ndarray, futures: list[tuple[int, int, Future]],
                 shape: tuple[int, int]) -> None:
        self.layer, self.ids, self._futures, self._shape = layer, ids, futures, shape

    def done(self) -> bool:
        return all(f.done() for _, _, f in self._futures)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        rows = np.empty((len(self.ids),) + self._shape, dtype=np.float32)  # [k, P, h]
        pos = {}
        for s, e, fut in self._futures:
            block = fut.result()  # [e - s, P, h]
            pos[s] = (e, block)
        # ids are sorted; place each id's row from the range that covers it
        starts = np.array(sorted(pos), dtype=np.int64)
        which = np.searchsorted(starts, self.ids, side="right") - 1
        for j, s in enumerate(starts.tolist()):
            sel = which == j
            rows[sel] = pos[s][1][self.ids[sel] - s]
        return self.ids, rows


class BundleStore:
    """Read-only access to a built store."""

    def __init__(self, path: Path, config: StoreConfig = StoreConfig()) -> None:
        self.path = Path(path)
        self.config = config
        try:
            meta = json.loads((self.path / "meta.json").read_text())
            self.crc = np.load(self.path / "crc.npy")
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
        self.row_shape = (len(self.parts), self.layout.hidden)  # one bundle as floats: [P, h]
        self.stats = IOStats()
        self._stats_lock = threading.Lock()
        self._fds: list[int] = []
        for layer in range(self.layout.num_layers):
            f = self.file(layer)
            want = self.layout.neurons * self.stride
            if not f.exists() or f.stat().st_size != want:
                self.close()
                raise CorruptStoreError(f"{f} is missing or has the wrong size (want {want} bytes); "
                                        "delete the store folder to rebuild it")
            self._fds.append(self._open(f))
        self._pool = ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="flotilla-sparse-io")

    def file(self, layer: int) -> Path:
        return self.path / f"layer-{layer:03d}.bin"

    def _open(self, f: Path) -> int:
        if self.config.direct and hasattr(os, "O_DIRECT"):
            try:
                return os.open(f, os.O_RDONLY | os.O_DIRECT)
            except OSError:  # tmpfs and some filesystems refuse O_DIRECT
                pass
        return os.open(f, os.O_RDONLY)

    @property
    def bundle_floats(self) -> int:
        return self.row_shape[0] * self.row_shape[1]

    # -- reads ------------------------------------------------------------------------
    def read_async(self, layer: int, ids: np.ndarray) -> PendingRead:
        """Start reading the bundles of sorted unique `ids`; returns at once."""
        ids = np.asarray(ids, dtype=np.int64)
        ranges = coalesce(ids, self.config.max_gap, self.config.max_run)
        futures = [(s, e, self._pool.submit(self._read_range, layer, s, e)) for s, e in ranges]
        return PendingRead(layer, ids, futures, self.row_shape)

    def read(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """Read bundles now: rows [k, P, h] in the order of sorted `ids`."""
        return self.read_async(layer, ids).result()[1]

    def _read_range(self, layer: int, start: int, end: int) -> np.ndarray:
        t0 = time.perf_counter()
        n = (end - start) * self.stride
        raw = np.empty(n + ALIGN, dtype=np.uint8)
        skip = (-raw.ctypes.data) % ALIGN  # O_DIRECT wants an aligned buffer
        buf = raw[skip:skip + n]
        got = os.preadv(self._fds[layer], [memoryview(buf)], start * self.stride)
        if got != n:
            raise CorruptStoreError(f"{self.file(layer)}: short read at bundle {start} ({got} of {n} bytes)")
        block = buf.reshape(end - start, self.stride)[:, :self.payload]  # [k, payload]
        if self.config.verify:
            want = self.crc[layer, start:end]
            for j in range(end - start):
                if zlib.crc32(block[j]) != want[j]:
                    raise CorruptStoreError(
                        f"{self.file(layer)}: neuron {start + j} fails its checksum; the store is damaged "
                        f"-- delete {self.path} to rebuild it from the model")
        out = block.view(np.float32).reshape((end - start,) + self.row_shape)  # [k, P, h]
        with self._stats_lock:
            self.stats.bytes_read += n
            self.stats.reads += 1
            self.stats.bundles += end - start
            self.stats.seconds += time.perf_counter() - t0
        return out

    def verify_all(self) -> None:
        """Check every bundle of every layer (raises CorruptStoreError)."""
        ids = np.arange(self.layout.neurons)
        for layer in range(self.layout.num_layers):
            self.read(layer, ids)

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        for fd in self._fds:
            os.close(fd)
        self._fds = []
