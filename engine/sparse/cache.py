"""The RAM neuron cache: one slab of bundle rows shared by all FFN layers.

Why one shared slab: the budget is a single number of bytes, and layers with
larger active sets should get more of it; LRU across layers does that.

Why an anonymous mmap reserved once at full size: the budget moves while the
engine runs. Growing only widens the view (pages are touched, so counted in
RSS, only when filled); shrinking compacts the kept rows to the front and
gives the tail back to the OS with madvise(DONTNEED), so RSS follows the
budget at once and never needs a second copy of the cache.

Portability: mmap.mmap(-1, n) is anonymous memory on every OS; POSIX adds
MAP_PRIVATE (see _anonymous), and madvise is used only where Python has it
(not on Windows: see _give_back for what that costs there).

Bundles can be read from disk straight into their slots (reserve() hands
out slots, unbuffered reads land in them, no copy): then a slot is `slot_bytes`
long (the store's 4 KiB-aligned stride) and the slab is page aligned. A slot
with a read in flight is pinned: never evicted, moved or handed out again.

Not thread safe on purpose: only the compute thread touches it (prefetched
rows are landed when the layer that needs them is about to run).
"""

from __future__ import annotations

import mmap

import numpy as np

from engine.runtime.budget import BudgetError  # one error type for every engine's budget (re-exported)

PAGE = mmap.PAGESIZE


def _anonymous(nbytes: int) -> mmap.mmap:
    """Zeroed anonymous memory of `nbytes`, touched pages only counted in RSS."""
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):  # POSIX
        # private: a virtual reservation only, and madvise(DONTNEED) really frees pages (on a
        # MAP_SHARED mapping -- mmap's default -- it only unmaps them: RSS drops, memory stays used)
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # Windows: a pagefile-backed section. Its whole size is charged against the commit limit
    # (RAM + pagefile) at once, though pages only take RAM when touched: a slab as big as every
    # FFN neuron of a large model may need the pagefile to grow, or fail with MemoryError/OSError.
    return mmap.mmap(-1, nbytes)


def _give_back(mm: mmap.mmap, start: int, length: int) -> None:
    """Return the pages of [start, start + length) to the OS where it can be asked to."""
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):  # POSIX (Python >= 3.8)
        mm.madvise(mmap.MADV_DONTNEED, start, length)
    # Windows has no madvise in Python: the trimmed tail stays committed and in the working set
    # until the memory manager trims it under pressure (to the pagefile), so RSS may not follow
    # the budget down. Output is unaffected: rows past the capacity are never read, only refilled.


class NeuronCache:
    def __init__(self, num_layers: int, neurons: int, row_shape: tuple[int, int],
                 budget_bytes: int, min_bytes: int, dtype=np.float32, slot_bytes: int | None = None) -> None:
        self.num_layers, self.neurons, self.row_shape = num_layers, neurons, row_shape
        self.dtype = np.dtype(dtype)  # the store's: 16-bit stores keep 16-bit rows (twice the neurons)
        self.payload = int(np.prod(row_shape)) * self.dtype.itemsize  # one bundle's bytes
        self.row_bytes = int(slot_bytes or self.payload)  # RAM per cached bundle (a slot)
        self.min_bytes = int(min_bytes)
        self.max_rows = num_layers * neurons  # more than this is never useful
        self._mm = _anonymous(self.max_rows * self.row_bytes)
        self._slab = np.frombuffer(self._mm, dtype=np.uint8).reshape(self.max_rows, self.row_bytes)
        self.base = self._slab.ctypes.data  # page aligned (mmap)
        self._all = self._slab[:, :self.payload].view(self.dtype).reshape((self.max_rows,) + row_shape)
        self.pinned = np.zeros(self.max_rows, dtype=bool)  # slot -> a read is landing in it
        self.slot_of = np.full((num_layers, neurons), -1, dtype=np.int32)  # [L, N] -> slot or -1
        self.key_of = np.full(self.max_rows, -1, dtype=np.int64)  # slot -> layer * N + neuron, or -1
        self.stamp = np.zeros(self.max_rows, dtype=np.int64)  # slot -> last tick used (LRU)
        self.tick = 1  # advanced once per (token, layer) step by the caller
        self.capacity = 0  # rows usable now
        self.hits = 0  # needed neurons found resident
        self.misses = 0  # needed neurons not resident
        self.resize(budget_bytes)

    # -- budget -------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self.capacity * self.row_bytes

    @property
    def used_rows(self) -> int:
        return int((self.key_of[:self.capacity] >= 0).sum())

    def check_budget(self, budget_bytes: int) -> None:
        if budget_bytes < self.min_bytes:
            raise BudgetError(f"a neuron cache budget of {budget_bytes / 2**20:.1f} MiB cannot hold one layer's "
                              f"active set; the minimum is {self.min_bytes / 2**20:.1f} MiB "
                              f"({self.min_bytes} bytes)")

    def resize(self, budget_bytes: int) -> None:
        """Grow or shrink to `budget_bytes` (kept rows stay valid: output never changes)."""
        self.check_budget(budget_bytes)
        new = min(self.max_rows, int(budget_bytes) // self.row_bytes)
        old = self.capacity
        if new < old:
            self._shrink(new)
        self.capacity = new

    def _shrink(self, new: int) -> None:
        old = self.capacity
        used = np.nonzero(self.key_of[:old] >= 0)[0]
        if len(used) > new:  # drop the least recently used rows
            order = np.argsort(self.stamp[used], kind="stable")
            drop = used[order[:len(used) - new]]
            self._forget(drop)
        # move rows living at slot >= new into free slots < new
        src = np.nonzero(self.key_of[new:old] >= 0)[0] + new
        if len(src):
            free = np.nonzero(self.key_of[:new] < 0)[0][:len(src)]
            self._all[free] = self._all[src]
            keys = self.key_of[src]
            self.key_of[free], self.stamp[free] = keys, self.stamp[src]
            self.slot_of[keys // self.neurons, keys % self.neurons] = free
            self.key_of[src] = -1
        start = -(-new * self.row_bytes // PAGE) * PAGE  # give whole pages past the new end back
        end = old * self.row_bytes
        if end > start:
            _give_back(self._mm, start, end - start)  # rows past `old` are unused too

    def _forget(self, slots: np.ndarray) -> None:
        keys = self.key_of[slots]
        self.slot_of[keys // self.neurons, keys % self.neurons] = -1
        self.key_of[slots] = -1

    # -- lookups --------------------------------------------------------------------------
    def lookup(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """Slots of ids (-1 where absent); marks the present ones used now."""
        slots = self.slot_of[layer, ids]
        present = slots[slots >= 0]
        self.stamp[present] = self.tick
        self.hits += len(present)
        self.misses += len(ids) - len(present)
        return slots

    def missing(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """The ids that are not resident (no stamping: for prefetch decisions)."""
        return ids[self.slot_of[layer, ids] < 0]

    def rows(self, slots: np.ndarray) -> np.ndarray:
        return self._all[slots]  # fancy indexing: a copy, [k, P, h]

    def insert(self, layer: int, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Store rows [k, P, h] of ids; returns their slots (-1 for those that did not
        fit: rows used at the current tick are never evicted). Ids already resident
        are skipped."""
        slots = np.full(len(ids), -1, dtype=np.int32)
        new = self.slot_of[layer, ids] < 0
        slots[~new] = self.slot_of[layer, ids[~new]]
        want = int(new.sum())
        if want == 0 or self.capacity == 0:
            return slots
        cand = np.nonzero((self.stamp[:self.capacity] < self.tick) & ~self.pinned[:self.capacity])[0]
        # (never evict what this step uses, nor a slot a read is landing in)
        if len(cand) > want:
            # free slots have key -1 and an old stamp; prefer them, then the LRU ones
            pri = np.where(self.key_of[cand] < 0, -1, self.stamp[cand])
            cand = cand[np.argpartition(pri, want - 1)[:want]]
        take = cand[:want]
        victims = take[self.key_of[take] >= 0]
        if len(victims):
            self._forget(victims)
        idx = np.nonzero(new)[0][:len(take)]
        self._all[take] = rows[idx]
        keys = layer * self.neurons + ids[idx]
        self.key_of[take], self.stamp[take] = keys, self.tick
        self.slot_of[layer, ids[idx]] = take
        slots[idx] = take
        return slots

    def reserve(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """Slots for the non-resident `ids` (sorted, unique), registered and pinned now,
        to be filled by a read into addr(slots); -1 where no slot was free. Call
        land() when the read completed, or drop() if it failed."""
        ids = np.asarray(ids, dtype=np.int64)
        want = len(ids)
        slots = np.full(want, -1, dtype=np.int64)
        if want == 0 or self.capacity == 0:
            return slots
        cand = np.nonzero((self.stamp[:self.capacity] < self.tick) & ~self.pinned[:self.capacity])[0]
        if len(cand) > want:
            pri = np.where(self.key_of[cand] < 0, -1, self.stamp[cand])
            cand = cand[np.argpartition(pri, want - 1)[:want]]
        take = np.sort(cand[:want])
        victims = take[self.key_of[take] >= 0]
        if len(victims):
            self._forget(victims)
        k = len(take)
        self.key_of[take], self.stamp[take] = layer * self.neurons + ids[:k], self.tick
        self.slot_of[layer, ids[:k]] = take
        self.pinned[take] = True
        slots[:k] = take
        return slots

    def addr(self, slots: np.ndarray) -> np.ndarray:
        return np.uint64(self.base) + slots.astype(np.uint64) * np.uint64(self.row_bytes)

    def payload_views(self, slots: np.ndarray) -> "SlotBytes":
        return SlotBytes(self._slab, slots, self.payload)

    def land(self, slots: np.ndarray) -> None:
        self.pinned[slots] = False

    def drop(self, slots: np.ndarray) -> None:
        """A read into these slots failed: they hold nothing valid."""
        self.pinned[slots] = False
        self._forget(slots[self.key_of[slots] >= 0])

    def clear(self) -> None:
        self._forget(np.nonzero(self.key_of[:self.capacity] >= 0)[0])

    def close(self) -> None:
        self._all = self._slab = None
        try:
            self._mm.close()
        except BufferError:  # a view still lives somewhere; the GC frees it later
            pass


class SlotBytes:
    """The payload bytes of some slots, one view per slot (no copies)."""

    def __init__(self, slab: np.ndarray, slots: np.ndarray, payload: int) -> None:
        self.slab, self.slots, self.payload = slab, slots, payload

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, j: int) -> np.ndarray:
        return self.slab[self.slots[j], :self.payload]
