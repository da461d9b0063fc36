"""The expert cache: a RAM budget cut into fixed slots, one expert blob each.

Slots are page-aligned anonymous mmaps allocated once, so the store reads
straight into them with O_DIRECT and the torch weight views over a slot stay
valid whatever expert it holds. Every page of a slot is written once when the
cache is made (`_committed_buffer`), not on the slot's first read. A resident
expert can be *pinned* (being computed with, or fetched for requests still
waiting for it); only unpinned ones are evicted.

Eviction: the victim is the unpinned expert whose next use is farthest away,
then the least frequently demanded, then the least recently used. Decoding
visits layers cyclically, so plain LRU evicts exactly the experts that come
back first. The scheduler tells the cache (plan()) where its requests are:
an expert of layer L is next needed after min over requests of the layers
between the request and L (a request that already routed layer p needs
layer p's other experts only on its next pass), and experts that routed
requests wait for now count as needed at once. No expert choice is predicted;
only the layer order is used. Frequency: every routing decision counts as a
demand for its expert (hit or miss), counts are halved every `decay_every`
demands so old popularity fades.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass

import numpy as np

from engine.moe.store import Key, StoreIndex
from engine.platform.pread import aligned_buffer
from engine.runtime.budget import BudgetError, fit_budget
from engine.runtime.stored import STORAGE_DTYPES

MB = 1e6
PAGE = mmap.PAGESIZE  # writing one byte per page touches every page


@dataclass
class _Slot:
    buf: object  # the aligned mmap the store reads into
    views: dict  # part name -> torch view over buf (gate_up [2I, H], down [H, I], int8 scales)
    key: Key | None = None  # what it holds; None when free or being filled
    pins: int = 0  # users that must not see it evicted
    filling: bool = False  # a fetch is writing into it


@dataclass
class CacheStats:
    demands: int = 0  # routing decisions counted (request, layer, expert)
    hits: int = 0  # of those, resident when routed
    evictions: int = 0  # experts dropped to make room
    inserts: int = 0  # experts loaded into slots (how many on a guess: the fetcher's FetchStats.speculative)
    unasked_unused: int = 0  # of those loaded on a guess, evicted before any request used them (read in vain)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.demands if self.demands else 0.0


@dataclass
class _Freq:
    count: float = 0.0  # demand count (decayed)
    last: int = 0  # demand clock of the last use


def min_budget_bytes(index: StoreIndex) -> int:
    """The smallest budget that works: one layer's top-k experts."""
    return index.top_k * index.blob_bytes


def working_bytes(hidden: int, heads: int, vocab: int, top_k: int, inter: int, chunk: int, context: int,
                  requests: int) -> int:
    """RAM one pass needs beyond weights, KV and cache (a generous estimate): the rows of a
    prefill chunk through attention and experts, its attention scores (heads x chunk x
    context, f32), every request's logits, two widened weight blocks, and slack."""
    from engine.runtime.stored import BLOCK_BYTES

    rows = chunk * (16 * hidden + 2 * top_k * inter) * 4
    scores = heads * chunk * context * 4
    logits = 2 * requests * vocab * 4
    return int(rows + scores + logits + 2 * BLOCK_BYTES + (32 << 20))


def plan_budget(index: StoreIndex, requested: int | None, room: int, kv_bytes: int, working: int) -> int:
    """The expert cache budget (engine.runtime.budget.fit_budget): the minimum is one
    layer's top-k experts, everything is every expert."""
    if requested is not None and requested < min_budget_bytes(index):
        need = min_budget_bytes(index)
        raise BudgetError(
            f"expert cache budget {requested / MB:.1f} MB is below one layer's top-{index.top_k} experts; "
            f"the minimum is {need / MB:.1f} MB ({index.top_k} x {index.blob_bytes / MB:.2f} MB); "
            f"all experts take {index.total_expert_bytes / MB:.1f} MB")
    return fit_budget(requested, min_budget_bytes(index), index.total_expert_bytes, room, kv_bytes, working,
                      what="expert cache")


class ExpertCache:
    def __init__(self, index: StoreIndex, budget_bytes: int, decay_every: int | None = None) -> None:
        import torch

        budget = int(budget_bytes)
        need = min_budget_bytes(index)
        if budget < need:
            raise BudgetError(
                f"expert cache budget {budget / MB:.1f} MB is below one layer's top-{index.top_k} experts; "
                f"the minimum is {need / MB:.1f} MB ({index.top_k} x {index.blob_bytes / MB:.2f} MB); "
                f"all experts take {index.total_expert_bytes / MB:.1f} MB")
        self.index = index
        self.budget_bytes = budget
        n = min(budget // index.blob_bytes, len(index.blobs))
        self._slots: list[_Slot] = []
        for _ in range(n):
            buf = _committed_buffer(index.blob_bytes)
            views = {p.name: torch.frombuffer(buf, dtype=STORAGE_DTYPES[p.dtype], count=_numel(p.shape),
                                              offset=p.offset).view(*p.shape) for p in index.parts}
            self._slots.append(_Slot(buf, views))
        self._where: dict[Key, int] = {}  # resident key -> slot
        self._freq: dict[Key, _Freq] = {}
        self._clock = 0
        self._decay_every = decay_every or max(64, 4 * n)
        self._dist: dict[int, int] = {}  # layer -> layers until some request needs it (plan())
        self._wanted: set[Key] = set()  # experts routed requests wait for now (plan())
        self._unused: set[Key] = set()  # loaded on a guess, not pinned by a request yet
        self._cond = threading.Condition()
        self.stats = CacheStats()

    @property
    def capacity(self) -> int:
        """Slots = experts the cache can hold."""
        return len(self._slots)

    # -- lookups (scheduler thread) -------------------------------------------------
    def demand(self, key: Key) -> bool:
        """Count one routing decision for `key`; True if it is resident now."""
        with self._cond:
            self._clock += 1
            f = self._freq.setdefault(key, _Freq())
            f.count += 1
            f.last = self._clock
            if self._clock % self._decay_every == 0:
                for g in self._freq.values():
                    g.count *= 0.5
            hit = key in self._where
            self.stats.demands += 1
            self.stats.hits += hit
            return hit

    def demand_many(self, keys: list[Key]) -> None:
        """demand() for each of `keys`, under one lock."""
        with self._cond:
            for key in keys:
                self._clock += 1
                f = self._freq.setdefault(key, _Freq())
                f.count += 1
                f.last = self._clock
                if self._clock % self._decay_every == 0:
                    for g in self._freq.values():
                        g.count *= 0.5
                self.stats.demands += 1
                self.stats.hits += key in self._where

    def plan(self, dist: dict[int, int], wanted: set[Key]) -> None:
        """Where the requests are: dist[layer] = layers until a request reaches it
        (missing: unknown, 0), wanted = experts routed requests wait for now."""
        with self._cond:
            self._dist, self._wanted = dist, wanted

    def resident(self, key: Key) -> bool:
        with self._cond:
            return key in self._where

    def pin(self, key: Key) -> dict | None:
        """Pin a resident expert and return its weight views; None if not resident."""
        with self._cond:
            i = self._where.get(key)
            if i is None:
                return None
            self._slots[i].pins += 1
            self._unused.discard(key)
            return self._slots[i].views

    def pin_many(self, keys) -> dict[Key, dict]:
        """pin() each of `keys` under one lock: {key: views} of the resident ones."""
        out = {}
        with self._cond:
            for key in keys:
                i = self._where.get(key)
                if i is not None:
                    self._slots[i].pins += 1
                    self._unused.discard(key)
                    out[key] = self._slots[i].views
        return out

    def unpin_many(self, keys) -> None:
        with self._cond:
            for key in keys:
                i = self._where.get(key)
                if i is not None and self._slots[i].pins > 0:
                    self._slots[i].pins -= 1
            self._cond.notify_all()

    def unpin(self, key: Key) -> None:
        with self._cond:
            i = self._where.get(key)
            if i is not None and self._slots[i].pins > 0:
                self._slots[i].pins -= 1
                if self._slots[i].pins == 0:
                    self._cond.notify_all()

    def unpin_all(self) -> None:
        """Drop every pin (the scheduler that held them is gone: engine._fail_running). A
        read in flight still lands pinned, and its arrival is reported as usual."""
        with self._cond:
            for s in self._slots:
                s.pins = 0
            self._cond.notify_all()

    def buffer(self, slot: int):
        """The aligned buffer of a reserved slot (for the store to read into)."""
        return self._slots[slot].buf

    def guessed_unused(self) -> int:
        """Experts loaded on a guess that no request used: evicted so, or still waiting."""
        with self._cond:
            return self.stats.unasked_unused + len(self._unused)

    def pinned(self) -> int:
        with self._cond:
            return sum(1 for s in self._slots if s.pins or s.filling)

    # -- filling (fetch threads) ---------------------------------------------------------
    def reserve(self, timeout: float | None = None) -> int | None:
        """A slot to fill: a free one, else evict the coldest unpinned expert.
        Waits (up to timeout) while every slot is pinned or filling."""
        with self._cond:
            while True:
                i = self._victim()
                if i is not None:
                    s = self._slots[i]
                    if s.key is not None:
                        del self._where[s.key]
                        self.stats.evictions += 1
                        if s.key in self._unused:
                            self._unused.discard(s.key)
                            self.stats.unasked_unused += 1
                    s.key, s.filling = None, True
                    return i
                if not self._cond.wait(timeout):
                    return None

    def commit(self, slot: int, key: Key, pins: int = 1, guess: bool = False) -> None:
        """The fetch of `key` into `slot` finished: make it resident (pinned for its waiters);
        guess: nobody asked for it (a prediction), counted as read in vain if evicted unused."""
        with self._cond:
            s = self._slots[slot]
            s.key, s.filling, s.pins = key, False, pins
            self._where[key] = slot
            self.stats.inserts += 1
            if guess:  # used once a request pins it
                self._unused.add(key)
            self._cond.notify_all()

    def release(self, slot: int) -> None:
        """A fetch failed: give the slot back empty."""
        with self._cond:
            self._slots[slot].filling = False
            self._slots[slot].key = None
            self._cond.notify_all()

    def _victim(self) -> int | None:
        best, best_score = None, None
        for i, s in enumerate(self._slots):
            if s.filling or s.pins:
                continue
            if s.key is None:
                return i
            f = self._freq.get(s.key) or _Freq()
            wanted = s.key in self._wanted
            score = (wanted, -self._dist.get(s.key[0], 0) if not wanted else 0, f.count, f.last)
            if best_score is None or score < best_score:
                best, best_score = i, score
        return best

    def preload(self, store, keys) -> None:
        """Fill the cache with `keys` (all-resident mode, warm starts); unpinned."""
        for key in keys:
            if self.resident(key):
                continue
            slot = self.reserve(timeout=0)
            if slot is None:
                break
            try:
                store.read_into(key, self._slots[slot].buf)
            except Exception:
                self.release(slot)
                raise
            self.commit(slot, key, pins=0)

    def close(self) -> None:
        with self._cond:
            self._slots.clear()
            self._where.clear()


def _committed_buffer(nbytes: int):
    """An aligned slot buffer with every page written once, now. The OS gives an anonymous
    mapping its pages on first touch; left to a slot's first read, that work (zeroing each
    page, and in a VM the host backing it) fell on a fetch thread in the middle of decoding,
    took more CPU than the read itself and slowed the scheduler's compute on a small CPU.
    Here it is paid once at set-up, and the cache holds its whole budget from the start."""
    buf = aligned_buffer(nbytes)
    np.frombuffer(buf, dtype=np.uint8)[::PAGE] = 0
    return buf


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
