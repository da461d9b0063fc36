"""Delta prefetch: read predicted - resident bundles while the model computes;
read what was mispredicted on demand, so every computed neuron is exact.

    issue(l + 1, predicted ids)   at layer l, as soon as its input is known:
                                  async reads of the non-resident ones
    rows(l, needed ids)           at layer l: resident rows + the prefetched
                                  ones + an on-demand read of the rest

The compute thread waits only for what is still missing when a layer runs;
that wait is the I/O share of the token latency.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from engine.sparse.cache import NeuronCache
from engine.sparse.store import BundleStore, PendingRead

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


class Prefetcher:
    def __init__(self, store: BundleStore, cache: NeuronCache) -> None:
        self.store, self.cache = store, cache
        self.pending: dict[int, PendingRead] = {}  # layer -> reads in flight for it
        self.stats = PrefetchStats()

    def issue(self, layer: int, ids: np.ndarray) -> None:
        """Start reading the predicted ids of `layer` that are not resident."""
        if layer in self.pending or len(ids) == 0:
            return
        miss = self.cache.missing(layer, ids)
        if len(miss):
            self.pending[layer] = self.store.read_async(layer, miss)
            self.stats.prefetched += len(miss)

    def rows(self, layer: int, need: np.ndarray) -> np.ndarray:
        """Rows [k, P, h] of the sorted ids `need`, from wherever they are."""
        cache = self.cache
        slots = cache.lookup(layer, need)  # stamps the resident ones: not evictable now
        miss = slots < 0
        if miss.any() and layer in self.pending:
            t0 = time.perf_counter()
            ids, got = self.pending.pop(layer).result()
            self.stats.wait_s += time.perf_counter() - t0
            cache.insert(layer, ids, got)
            again = cache.slot_of[layer, need[miss]]
            used = again >= 0
            self.stats.prefetch_used += int(used.sum())
            cache.stamp[again[used]] = cache.tick
            slots[np.nonzero(miss)[0][used]] = again[used]
            miss = slots < 0
        elif layer in self.pending:  # everything was resident: land the reads anyway
            ids, got = self.pending.pop(layer).result()
            cache.insert(layer, ids, got)
        self.stats.needed += len(need)
        out = np.empty((len(need),) + cache.row_shape, dtype=np.float32)  # [k, P, h]
        have = ~miss
        out[have] = cache.rows(slots[have])
        if miss.any():
            ids = need[miss]
            t0 = time.perf_counter()
            got = self.store.read(layer, ids)
            self.stats.wait_s += time.perf_counter() - t0
            self.stats.on_demand += len(ids)
            out[miss] = got
            cache.insert(layer, ids, got)
        return out

    def drain(self) -> None:
        """Wait for reads in flight and drop them (before a resize or at close)."""
        for p in self.pending.values():
            try:
                p.result()
            except Exception:
                pass
        self.pending.clear()
