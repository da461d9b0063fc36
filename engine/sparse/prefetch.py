"""Delta prefetch: read predicted - resident bundles while the model computes;
read what was mispredicted on demand, so every computed neuron is exact.

    issue(l + 1, predicted ids)   at layer l, as soon as its input is known:
                                  async reads of the non-resident ones
    plan(l, needed ids)           at layer l, as soon as its exact set is known:
                                  looks up the cache, submits one batched
                                  on-demand read of needed - resident -
                                  in-flight, and returns the rows chunk by
                                  chunk: resident first (computed while the
                                  reads are in flight), then the prefetched
                                  ones, then the on-demand ones

The compute thread waits only for what is still missing when it has
computed everything else; that wait is the I/O share of the token latency.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from engine.sparse.cache import NeuronCache
from engine.sparse.store import BundleStore

SOURCES = ("lowrank", "temporal", "both", "none")


@dataclass
class PrefetchStats:
    wait_s: float = 0.0  # compute thread blocked on reads (prefetch collection + on demand)
    prefetched: int = 0  # bundles read ahead of need
    prefetch_used: int = 0  # ... of which the layer then needed
    on_demand: int = 0  # bundles read when the layer already needed them (misses)
    needed: int = 0  # bundles the layers computed with (hits + prefetched + on demand)

    def snapshot(self) -> dict:
        return asdict(self)


class Slots(np.ndarray):
    """A chunk given as cache slots (not copied rows): the compute reads the cache in place."""


def as_slots(slots: np.ndarray) -> Slots:
    return np.asarray(slots, dtype=np.int64).view(Slots)


class Prefetcher:
    """Two ways to land bundles. Direct (the cache's slots are the store's
    4 KiB-aligned stride): reads go straight into reserved cache slots, no
    copy. Buffered (tiny bundles, where padding each slot to 4 KiB would waste
    RAM): reads go to a batch buffer and are copied into the cache."""

    def __init__(self, store: BundleStore, cache: NeuronCache, spill_slice: int = 1 << 62) -> None:
        self.store, self.cache = store, cache
        # every chunk plan() yields holds at most this many rows: rows gathered out of the cache
        # and rows read into a buffer (a spill, or any read in buffered mode) alike, the next
        # read waiting while the one before is computed, so no step holds a whole layer
        self.spill_slice = max(1, int(spill_slice))
        self.direct = cache.row_bytes == store.stride
        self.in_place = False  # yield resident chunks as Slots (the runtime sets it when it can compute in place)
        self.pending: dict[int, object] = {}  # layer -> reads in flight for it (PendingRead / (DirectRead, slots))
        self.stats = PrefetchStats()

    def issue(self, layer: int, ids: np.ndarray) -> None:
        """Start reading the predicted ids of `layer` that are not resident."""
        if layer in self.pending or len(ids) == 0:
            return
        miss = self.cache.missing(layer, ids)
        if not len(miss):
            return
        if self.direct:
            slots = self.cache.reserve(layer, miss)
            ok = slots >= 0
            miss, slots = miss[ok], slots[ok]
            if not len(miss):
                return
            self.pending[layer] = (self.store.read_into(layer, miss, self.cache.addr(slots),
                                                        self.cache.payload_views(slots)), slots)
        else:
            self.pending[layer] = self.store.read_async(layer, miss)
        self.stats.prefetched += len(miss)

    def _land(self, layer: int) -> np.ndarray | None:
        """Direct mode: wait for the prefetch of `layer`; returns its ids."""
        pend = self.pending.pop(layer, None)
        if pend is None:
            return None
        rd, slots = pend
        t0 = time.perf_counter()
        try:
            rd.wait()
        except BaseException:
            self.cache.drop(slots)
            raise
        finally:
            self.stats.wait_s += time.perf_counter() - t0
        self.cache.land(slots)
        return rd.ids

    def plan(self, layer: int, need: np.ndarray):
        """Chunks (positions in `need`, rows [k, P, h]) covering the sorted ids `need`.
        The on-demand read is submitted before this returns; iterate the result
        to the end (it also lands the reads in the cache)."""
        if not self.direct:
            return self._plan_buffered(layer, need)
        cache = self.cache
        pre = self._land(layer)  # prefetched rows: resident from here on
        slots = cache.lookup(layer, need)  # stamps the resident ones: not evictable now
        have = slots >= 0
        if pre is not None:
            self.stats.prefetch_used += int(np.isin(need, pre, assume_unique=True).sum())
        miss_pos = np.nonzero(~have)[0]
        got = cache.reserve(layer, need[miss_pos])
        ok = got >= 0
        rd = None
        if ok.any():
            rd = self.store.read_into(layer, need[miss_pos[ok]], cache.addr(got[ok]), cache.payload_views(got[ok]))
        spill = miss_pos[~ok]  # no free slot (an active set larger than calibrated): read, use, don't keep
        sp = self.store.read_async(layer, need[spill[:self.spill_slice]]) if len(spill) else None
        self.stats.needed += len(need)
        self.stats.on_demand += len(miss_pos)
        return self._chunks_direct(layer, need, slots, have, miss_pos[ok], got[ok], rd, spill, sp)

    def _chunks_direct(self, layer, need, slots, have, pos, got, rd, spill, sp):
        cache = self.cache
        view = as_slots if self.in_place else cache.rows  # cache.rows copies: a slice at a time
        yield from self._sliced(np.nonzero(have)[0], slots, view)  # computed while the reads are in flight
        if rd is not None:
            t0 = time.perf_counter()
            try:
                rd.wait()
            except BaseException:
                cache.drop(got)
                raise
            finally:
                self.stats.wait_s += time.perf_counter() - t0
            cache.land(got)
            yield from self._sliced(np.arange(len(pos)), got, view, pos)
        for part, _ids, rows in self._read_sliced(layer, need, spill, sp):
            yield part, rows

    def _read_sliced(self, layer: int, need: np.ndarray, positions: np.ndarray, first):
        """(positions, ids, rows) of need[positions] read spill_slice at a time; `first` is the
        read of the first slice (submitted by plan()), the next is read while one is used."""
        step, pending = self.spill_slice, first
        for i in range(0, len(positions), step):
            t0 = time.perf_counter()
            ids, rows = pending.result()
            self.stats.wait_s += time.perf_counter() - t0
            nxt = positions[i + step:i + 2 * step]
            pending = self.store.read_async(layer, need[nxt]) if len(nxt) else None
            yield positions[i:i + step], ids, rows

    def _sliced(self, idx: np.ndarray, slots: np.ndarray, view, pos: np.ndarray | None = None):
        """(positions, view(slots[i])) for the indexes i of idx, spill_slice at a time: the
        positions are pos[i] (pos None: i itself)."""
        step = self.spill_slice
        for i in range(0, len(idx), step):
            part = idx[i:i + step]
            yield (part if pos is None else pos[part]), view(slots[part])

    def _plan_buffered(self, layer: int, need: np.ndarray):
        cache = self.cache
        slots = cache.lookup(layer, need)  # stamps the resident ones: not evictable now
        miss = slots < 0
        pend = self.pending.pop(layer, None)
        covered = np.zeros(len(need), dtype=bool)
        if pend is not None and miss.any():
            covered[miss] = np.isin(need[miss], pend.ids, assume_unique=True)
        rest = np.nonzero(miss & ~covered)[0]  # positions read on demand, a slice at a time
        od = self.store.read_async(layer, need[rest[:self.spill_slice]]) if len(rest) else None
        self.stats.needed += len(need)
        self.stats.on_demand += len(rest)
        self.stats.prefetch_used += int(covered.sum())
        return self._chunks_buffered(layer, need, slots, ~miss, pend, covered, od, rest)

    def _chunks_buffered(self, layer, need, slots, have, pend, covered, od, rest):
        cache = self.cache
        yield from self._sliced(np.nonzero(have)[0], slots, cache.rows)
        if pend is not None:
            t0 = time.perf_counter()
            ids, got = pend.result()
            self.stats.wait_s += time.perf_counter() - t0
            cov = np.nonzero(covered)[0]
            yield from self._sliced(np.arange(len(cov)), np.searchsorted(ids, need[cov]), lambda at: got[at], cov)
            cache.insert(layer, ids, got)  # the unneeded ones too: the LRU decides
        for part, ids, got in self._read_sliced(layer, need, rest, od):
            yield part, got
            cache.insert(layer, ids, got)

    def rows(self, layer: int, need: np.ndarray) -> np.ndarray:
        """All rows [k, P, h] of the sorted ids `need` in one array (a copy)."""
        out = np.empty((len(need),) + self.cache.row_shape, dtype=self.cache.dtype)
        for pos, rows in self.plan(layer, need):
            out[pos] = self.cache.rows(rows) if isinstance(rows, Slots) else rows
        return out

    def drain(self) -> None:
        """Wait for reads in flight and land or drop them (before a resize or at close)."""
        for layer in list(self.pending):
            try:
                if self.direct:
                    self._land(layer)
                else:
                    self.pending.pop(layer).result()
            except Exception:
                pass
        self.pending.clear()
