"""The paged KV cache's block bookkeeping: refcounts, the prompt cache's whole-block
prefixes, eviction of kept blocks only when the free list is dry."""

import pytest

from engine.runtime.kv_blocks import BlockPool

BS = 4


def test_allocate_until_dry_and_release_gives_blocks_back():
    pool = BlockPool(5, BS, keep=False)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.available == 2
    assert pool.allocate(3) is None and pool.available == 2  # nothing taken on a refusal
    pool.release(a, list(range(12)))
    assert pool.available == 5 and pool.match(list(range(20))) == []  # keep off: nothing kept


def test_a_prompt_takes_over_the_whole_blocks_of_its_own_prefix_only():
    pool = BlockPool(8, BS)
    fed = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # two whole blocks and a partial one
    blocks = pool.allocate(3)
    pool.release(blocks, fed)
    assert pool.match([1, 2, 3, 4, 5, 6, 7, 8, 99, 98]) == blocks[:2]
    assert pool.match([1, 2, 3, 4, 0, 6, 7, 8, 9, 10]) == blocks[:1]  # diverges in block 2
    assert pool.match([9, 2, 3, 4, 5, 6, 7, 8, 9]) == []  # a prefix key, not a block's own ids
    # never the block of the prompt's last id: it is fed again for its logits
    assert pool.match([1, 2, 3, 4, 5, 6, 7, 8]) == blocks[:1]


def test_held_kept_blocks_are_never_evicted_and_free_ones_go_first():
    pool = BlockPool(4, BS)
    first = pool.allocate(2)
    pool.release(first, list(range(8)))  # both kept
    held = pool.match(list(range(9)))  # held again by a running prompt
    assert held == first and pool.available == 2
    other = pool.allocate(2)  # the two free ones, not the held kept ones
    assert set(other).isdisjoint(first)
    assert pool.allocate(1) is None
    pool.release(held, list(range(8)))
    assert sorted(pool.allocate(2)) == sorted(first)  # kept and held by nobody: evicted when needed


def test_eviction_is_oldest_first_and_drops_the_key():
    pool = BlockPool(2, BS)
    a = pool.allocate(1)
    pool.release(a, [1, 2, 3, 4])
    b = pool.allocate(1)
    pool.release(b, [5, 6, 7, 8])
    pool.match([5, 6, 7, 8, 0])  # b used again: a is now the oldest
    pool.release(b, ())
    got = pool.allocate(1)
    assert got == a and pool.match([1, 2, 3, 4, 0]) == [] and pool.match([5, 6, 7, 8, 0]) == b


def test_turning_the_cache_off_frees_what_nobody_holds():
    pool = BlockPool(3, BS)
    a = pool.allocate(2)
    pool.release(a[:1], [1, 2, 3, 4])
    pool.set_keep(False)
    assert pool.available == 2 and pool.match([1, 2, 3, 4, 5]) == []
    pool.release(a[1:], ())
    assert pool.available == 3


def test_bad_sizes():
    with pytest.raises(ValueError):
        BlockPool(0, BS)
