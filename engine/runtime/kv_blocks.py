"""The blocks of a paged KV cache: who holds which, and which full blocks a new prompt
can take over from earlier answers (prompt caching). Pure bookkeeping: the KV values
themselves live in the compiled model's cache tensors (engine/runtime/ov_paged.py).

A sequence's KV is a list of block ids, `block_size` positions each. A block is
free, held by running sequences (refcount > 0), or kept: full, written by an answer
that has ended, findable by the token ids of the whole prefix it ends (a hash chain),
and given up to a new sequence only when the free list is empty, oldest first.

Shared blocks are read, never written: a new prompt takes over only whole blocks of
its own prefix, and never its last token's block (that token runs again to give the
next token's logits, and its KV would be written into the block others read).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np


def _chain(parent: bytes, ids: Sequence[int]) -> bytes:
    """The key of a full block: its prefix's key and its own ids, hashed."""
    return hashlib.blake2b(parent + np.asarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()


class BlockPool:
    """`blocks` blocks of `block_size` positions; refcounts and the prompt cache."""

    def __init__(self, blocks: int, block_size: int, keep: bool = True) -> None:
        if blocks < 1 or block_size < 1:
            raise ValueError("a KV pool needs at least one block of at least one position")
        self.blocks, self.block_size = blocks, block_size
        self.keep = keep  # keep the full blocks of ended answers (prompt caching)
        self._free: collections.deque[int] = collections.deque(range(blocks))
        self._refs = [0] * blocks
        self._kept: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> block, oldest first
        self._key_of: dict[int, bytes] = {}  # block -> its key, for kept blocks

    @property
    def available(self) -> int:
        """Blocks a sequence could get now: free ones and kept ones nobody holds."""
        return len(self._free) + sum(1 for b in self._kept.values() if self._refs[b] == 0)

    @property
    def free_blocks(self) -> int:
        """Blocks neither held nor kept."""
        return len(self._free)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def match(self, prompt_ids: Sequence[int]) -> list[int]:
        """Take over the kept blocks holding the longest whole-block prefix of prompt_ids
        (never the block of its last id); the caller holds them until release()."""
        found: list[int] = []
        key = b""
        full = (len(prompt_ids) - 1) // self.block_size  # blocks wholly before the last id
        for i in range(full):
            key = _chain(key, prompt_ids[i * self.block_size:(i + 1) * self.block_size])
            block = self._kept.get(key)
            if block is None:
                break
            self._kept.move_to_end(key)  # used again: evicted last
            found.append(block)
        for b in found:
            self._refs[b] += 1
        return found

    def allocate(self, n: int) -> list[int] | None:
        """n blocks for one sequence, or None (nothing taken) when fewer are available."""
        if n <= 0:
            return []
        if n > len(self._free):
            spare = [k for k, b in self._kept.items() if self._refs[b] == 0][:n - len(self._free)]
            if len(self._free) + len(spare) < n:
                return None
            for k in spare:  # the oldest kept blocks nobody holds
                self._free.append(self._kept.pop(k))
                del self._key_of[self._free[-1]]
        got = [self._free.popleft() for _ in range(n)]
        for b in got:
            self._refs[b] = 1
        return got

    def release(self, blocks: Sequence[int], fed: Sequence[int] = ()) -> None:
        """A sequence lets go of its blocks; `fed` are the ids its KV holds, in order, so
        its full blocks are kept for later prompts (when keep is on)."""
        key = b""
        for i, b in enumerate(blocks):
            whole = (i + 1) * self.block_size <= len(fed)
            if whole and self.keep:
                key = _chain(key, fed[i * self.block_size:(i + 1) * self.block_size])
                if b not in self._key_of and key not in self._kept:
                    self._kept[key] = b
                    self._key_of[b] = key
                elif key in self._kept:
                    self._kept.move_to_end(key)
            self._refs[b] -= 1
            if self._refs[b] == 0 and b not in self._key_of:
                self._free.append(b)

    def set_keep(self, keep: bool) -> None:
        """Prompt caching on or off; off frees every kept block nobody holds."""
        self.keep = keep
        if not keep:
            for k, b in list(self._kept.items()):
                del self._kept[k], self._key_of[b]
                if self._refs[b] == 0:
                    self._free.append(b)
