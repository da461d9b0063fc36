"""The fetcher: a pool of threads reading expert blobs into cache slots.

Schedulers ask for experts with a priority (Bevy: how many requests wait for
it; the baselines: "now"). Workers take the most wanted one, reserve a slot
(evicting a cold expert), read the blob with O_DIRECT and verify its checksum
-- file reads, xxhash and the memcpy-free DMA all release the GIL, so this
runs while the scheduler thread computes. A fetch made for waiting requests
lands *held* (pinned once) until the scheduler has used it, so it cannot be
evicted before its waiters ran; a speculative fetch (prediction baseline)
lands unpinned.

An *idle-fill* fetch (priority below 0: the bevy_guess ablation's guesses) is
a read the disk does only when it has nothing else to do: it is taken after
every real request, and at most one is in flight, so a request that arrives
meanwhile finds the other threads free for it.

The fetcher also keeps where its idle time went: the scheduler names what it is
doing (`phase`), and every stretch with nothing to read (idle-fill guesses
aside) is added to that phase (`idle_by_phase`) -- the gaps a scheduler leaves the
disk, which the benchmark reports beside the overlap bound.

A failed read (I/O error, checksum mismatch) is recorded per expert; the
scheduler ends the requests that need it with that error.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass

from engine.moe.cache import ExpertCache
from engine.moe.store import ExpertStore, Key

log = logging.getLogger(__name__)

MAX_FILL_INFLIGHT = 1  # idle-fill reads in flight at once (the other threads stay free for real misses)


def is_fill(priority: float) -> bool:
    """An idle-fill priority (below every real request's, which are >= 0)."""
    return priority < 0.0


@dataclass
class FetchStats:
    fetched: int = 0  # blobs read
    speculative: int = 0  # of those, fetched on a prediction
    fills: int = 0  # of those, idle-fill guesses (bevy_guess)
    busy_s: float = 0.0  # wall time with at least one read in flight (disk busy)
    read_s: float = 0.0  # sum of per-read times over all threads


class Fetcher:
    def __init__(self, store: ExpertStore, cache: ExpertCache, threads: int = 4) -> None:
        self.store = store
        self.cache = cache
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Key]] = []  # (-priority, order, key); stale entries skipped
        self._queued: dict[Key, float] = {}  # key -> current priority (in the heap, not started)
        self._hold: dict[Key, bool] = {}  # key -> pin on arrival (someone waits for it)
        self._inflight: set[Key] = set()
        self._fills: set[Key] = set()  # idle-fill reads in flight
        self._arrived: list[Key] = []  # landed, held, not yet handed to the scheduler
        self.errors: dict[Key, BaseException] = {}
        self._order = itertools.count()
        self._stop = False
        self._busy_since: float | None = None
        self._phase = "engine"  # what the scheduler is doing (phase())
        self._mark = time.perf_counter()  # idle time is tallied up to here
        self._idle_s: dict[str, float] = {}  # phase -> wall time with nothing to read during it
        self.stats = FetchStats()
        self._threads = [threading.Thread(target=self._work, name=f"moe-fetch-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    # -- scheduler side ---------------------------------------------------------------
    def request(self, key: Key, priority: float = 0.0, hold: bool = True) -> bool:
        """Ask for `key` (no-op if resident, queued or in flight; the priority and
        hold are raised if it already is queued). True if it will land held and be
        reported by take_arrived (False: resident already, or its fetch failed)."""
        with self._cv:
            if not is_fill(priority):
                self._tally()  # the idle stretch (if any) ends here
            if key in self.errors:
                return False
            if key in self._inflight:
                if hold:
                    self._hold[key] = True
                return self._hold.get(key, False)
            if key in self._queued:
                self._hold[key] = self._hold.get(key, False) or hold
                if priority > self._queued[key]:
                    self._queued[key] = priority
                    heapq.heappush(self._heap, (-priority, next(self._order), key))
                return self._hold[key]
            if self.cache.resident(key):
                return False
            self._queued[key] = priority
            self._hold[key] = hold
            heapq.heappush(self._heap, (-priority, next(self._order), key))
            self._cv.notify()
            return hold

    def pending(self, key: Key) -> bool:
        with self._cv:
            return key in self._queued or key in self._inflight

    def drop(self, key: Key) -> None:
        """Nobody needs a queued `key` any more (its requests were cancelled)."""
        with self._cv:
            self._tally()
            self._queued.pop(key, None)

    def drop_fills(self) -> None:
        """Forget the idle-fill guesses still queued (a newer guess replaces them); a
        key a real request has asked for since keeps its place."""
        with self._cv:
            for key in [k for k, pri in self._queued.items() if is_fill(pri)]:
                del self._queued[key]
                self._hold.pop(key, None)

    def take_arrived(self, wait_s: float = 0.0) -> list[Key]:
        """Experts that landed held since the last call (waits up to wait_s for one)."""
        with self._cv:
            if not self._arrived and wait_s > 0 and (self._queued or self._inflight):
                self._cv.wait(wait_s)
            out, self._arrived = self._arrived, []
            return out

    def idle(self) -> bool:
        """Nothing to read but idle-fill guesses."""
        with self._cv:
            return self._idle()

    def busy_time(self) -> float:
        """Seconds the disk has had a read in flight so far (the stretch under way included)."""
        with self._cv:
            open_s = 0.0 if self._busy_since is None else time.perf_counter() - self._busy_since
            return self.stats.busy_s + open_s

    def phase(self, name: str) -> str:
        """The scheduler now does `name` (its idle time is counted there); returns the
        phase it left."""
        with self._cv:
            self._tally()
            prev, self._phase = self._phase, name
            return prev

    def idle_by_phase(self) -> dict[str, float]:
        """Seconds with nothing to read (idle-fill guesses aside), by the scheduler's phase."""
        with self._cv:
            self._tally()
            return dict(self._idle_s)

    def _idle(self) -> bool:
        return not self._inflight - self._fills and not any(not is_fill(p) for p in self._queued.values())

    def _tally(self) -> None:
        """Under the lock, before the phase or the idle state changes: the time since the
        last tally was idle (or not) in the current phase."""
        now = time.perf_counter()
        if self._idle():
            self._idle_s[self._phase] = self._idle_s.get(self._phase, 0.0) + now - self._mark
        self._mark = now

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5)

    # -- worker side ---------------------------------------------------------------------
    def _next(self) -> Key | None:
        with self._cv:
            while not self._stop:
                while self._heap:
                    neg, _, key = self._heap[0]
                    if self._queued.get(key) != -neg:  # a stale or dropped entry
                        heapq.heappop(self._heap)
                        continue
                    if is_fill(-neg) and len(self._fills) >= MAX_FILL_INFLIGHT:
                        break  # only guesses left, and one is being read: wait
                    heapq.heappop(self._heap)
                    del self._queued[key]
                    self._inflight.add(key)
                    if is_fill(-neg):
                        self._fills.add(key)
                    if self._busy_since is None:
                        self._busy_since = time.perf_counter()
                    return key
                self._cv.wait()
            return None

    def _work(self) -> None:
        while (key := self._next()) is not None:
            slot = None
            t0 = time.perf_counter()
            try:
                while slot is None and not self._stop:
                    slot = self.cache.reserve(timeout=0.1)
                if slot is None:
                    break
                self.store.read_into(key, self.cache.buffer(slot))
                with self._cv:
                    hold = self._hold.pop(key, True)
                self.cache.commit(slot, key, pins=1 if hold else 0, guess=not hold)
                self._finish(key, t0, arrived=hold, speculative=not hold)
            except BaseException as e:  # recorded; the scheduler fails the requests that need it
                if slot is not None:
                    self.cache.release(slot)
                log.error("fetching expert %s failed: %s", key, e)
                with self._cv:
                    self.errors[key] = e
                    self._hold.pop(key, None)
                self._finish(key, t0, arrived=False, speculative=False)

    def _finish(self, key: Key, t0: float, arrived: bool, speculative: bool) -> None:
        now = time.perf_counter()
        with self._cv:
            self._tally()
            self._inflight.discard(key)
            self.stats.read_s += now - t0
            if key not in self.errors:
                self.stats.fetched += 1
                self.stats.speculative += speculative
                self.stats.fills += key in self._fills
            self._fills.discard(key)
            if not self._inflight and self._busy_since is not None:
                self.stats.busy_s += now - self._busy_since
                self._busy_since = None
            if arrived:
                self._arrived.append(key)
            self._cv.notify_all()
