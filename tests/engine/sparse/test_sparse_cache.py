"""The neuron cache: LRU, resize keeps rows valid, budget minimum refused, RSS follows;
and the same on what Windows offers (mmap(-1, n), no madvise)."""

import mmap

import numpy as np
import pytest

from engine.sparse.cache import BudgetError, NeuronCache
from engine.sparse.memory import BudgetGovernor, MemoryPolicy, process_rss


def rows_for(layer, ids, shape=(2, 8)):
    return np.stack([np.full(shape, layer * 1000 + i, dtype=np.float32) for i in ids])


def test_insert_lookup_evict_and_shrink_keeps_contents():
    c = NeuronCache(2, 50, (2, 8), budget_bytes=20 * 64, min_bytes=5 * 64)
    assert c.capacity == 20
    for t in range(4):
        c.tick += 1
        ids = np.arange(t * 10, t * 10 + 10)
        c.insert(t % 2, ids, rows_for(t % 2, ids))
    assert c.used_rows == 20
    slots = c.lookup(1, np.arange(30, 40))  # the last insert is resident
    assert (slots >= 0).all()
    np.testing.assert_array_equal(c.rows(slots)[:, 0, 0], 1000 + np.arange(30, 40))
    c.resize(8 * 64)  # keep the 8 most recent rows, moved to the front
    assert c.capacity == 8 and c.used_rows == 8
    keys = c.key_of[:8]
    for s, k in enumerate(keys):
        layer, n = divmod(int(k), 50)
        assert c._all[s, 0, 0] == layer * 1000 + n and c.slot_of[layer, n] == s
    with pytest.raises(BudgetError, match="minimum is"):
        c.resize(4 * 64)


def test_rows_in_use_are_never_evicted():
    c = NeuronCache(1, 100, (1, 4), budget_bytes=10 * 16, min_bytes=16)
    c.tick += 1
    c.insert(0, np.arange(10), rows_for(0, np.arange(10), (1, 4)))
    c.tick += 1
    c.lookup(0, np.arange(5))  # in use now
    got = c.insert(0, np.arange(20, 30), rows_for(0, np.arange(20, 30), (1, 4)))
    assert (got >= 0).sum() == 5  # only the 5 unused rows could make room
    assert (c.slot_of[0, :5] >= 0).all()


def test_rss_follows_the_cache_budget():
    big = 64 * 2**20
    c = NeuronCache(4, 4096, (2, 1024), budget_bytes=big, min_bytes=2**20)
    before = process_rss()
    ids = np.arange(4096)
    for layer in range(2):
        c.tick += 1
        c.insert(layer, ids, np.ones((4096, 2, 1024), dtype=np.float32))
    full = process_rss()
    assert full - before > 0.8 * big
    c.resize(8 * 2**20)
    assert process_rss() < full - 0.7 * big
    # the pages are really given back (a private mapping), not just unmapped: they read as zeros now
    assert not c._slab[c.capacity + 1:4096].any()
    c.close()


def test_cache_works_without_map_private_and_madvise(monkeypatch):
    """Windows' mmap has neither: the slab is mmap(-1, n) and a shrink gives nothing back,
    but kept rows stay valid and the freed tail is refilled correctly after growing."""
    monkeypatch.delattr(mmap, "MAP_PRIVATE")
    monkeypatch.delattr(mmap, "MADV_DONTNEED")
    shape = (2, 1024)  # 8 KiB rows: a shrink spans whole pages, so the give-back step runs
    row = 2 * 1024 * 4
    c = NeuronCache(2, 50, shape, budget_bytes=20 * row, min_bytes=4 * row)
    for t in range(4):
        c.tick += 1
        ids = np.arange(t * 10, t * 10 + 10)
        c.insert(t % 2, ids, rows_for(t % 2, ids, shape))
    c.resize(8 * row)
    assert c.capacity == 8 and c.used_rows == 8
    for s, k in enumerate(c.key_of[:8]):
        layer, n = divmod(int(k), 50)
        assert (c._all[s] == layer * 1000 + n).all()
    c.resize(20 * row)
    c.tick += 1
    ids = np.arange(40, 50)
    c.insert(0, ids, rows_for(0, ids, shape))
    slots = c.lookup(0, ids)
    assert (slots >= 0).all()
    np.testing.assert_array_equal(c.rows(slots)[:, 1, 5], np.arange(40, 50))
    c.close()


def test_governor_shrinks_on_low_free_ram_and_grows_back():
    free = {"v": 10 * 2**30}
    g = BudgetGovernor(1000, 100, MemoryPolicy(reserve_bytes=2**30, check_every_s=0,
                                                available=lambda: free["v"]))
    assert g.propose(1000, now=1) is None
    free["v"] = 2**30 - 700  # 700 bytes short of the reserve
    assert g.propose(1000, now=2) == 300
    free["v"] = 2**30 - 10_000
    assert g.propose(300, now=3) == 100  # never below the minimum
    free["v"] = 10 * 2**30
    assert g.propose(100, now=4) == 1000  # never above the user's budget
