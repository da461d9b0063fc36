"""Which kept KV state a new prompt can start from: the one rule of prompt caching.

An engine keeps the KV state of finished answers (the loop engine on its idle
InferRequests, the MoE engine in its free KV slots, the sparse engine as torch caches --
each in a KeptStates --, the pipeline as parked streams on every stage), each with the
token ids it holds. A new prompt takes the one sharing the longest prefix with it: at least
MIN_REUSE ids (a shorter match is the first words of a template, not worth a trim),
never the whole prompt (its last id must run to give the next token's logits). What
the state holds past the shared prefix is trimmed away. Pure.

`grid` > 1 keeps only whole prefill chunks (a multiple of grid ids): below the default
f32, a prefill's logits depend on how the prompt was split into chunks (OpenVINO's CPU
kernels round differently per chunk shape; docs/api.md), so a cached turn is exact --
the answer a fresh request gets -- only if every kept position was computed in the very
chunks a fresh prefill would use: [0, grid), [grid, 2 grid), ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")

MIN_REUSE = 16


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids a and b share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    same = np.asarray(a[:n]) == np.asarray(b[:n])
    return n if bool(same.all()) else int(np.argmin(same))


def best_reuse(held: Sequence[Sequence[int]], prompt_ids: Sequence[int], grid: int = 1
               ) -> tuple[int | None, int]:
    """(index into held of the state to start from, ids of it to keep), or (None, 0).
    With grid > 1, held[i] must list only ids computed on that chunk grid."""
    best, reuse = None, 0
    for i, ids in enumerate(held):
        n = min(common_prefix(ids, prompt_ids), len(prompt_ids) - 1)
        n -= n % max(1, grid)
        if n >= MIN_REUSE and n > reuse:
            best, reuse = i, n
    return best, reuse


class KeptStates(Generic[T]):
    """The KV states an engine keeps for later prompts, oldest first, each with the ids it
    holds: the bookkeeping of the local loop's idle requests, the MoE engine's free KV slots
    and the torch streams' caches. Not locked: its owner locks."""

    def __init__(self) -> None:
        self._kept: list[tuple[T, list[int]]] = []

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def tokens(self) -> int:
        """Positions the kept states hold."""
        return sum(len(held) for _s, held in self._kept)

    def keep(self, state: T, held: Sequence[int]) -> None:
        self._kept.append((state, list(held)))

    def take(self, prompt_ids: Sequence[int]) -> tuple[T, list[int], int] | None:
        """Out of the container, the state a prompt starts from (best_reuse): (it, the ids it
        holds, how many of them to keep); None when none shares enough."""
        best, reuse = best_reuse([held for _s, held in self._kept], prompt_ids)
        if best is None:
            return None
        state, held = self._kept.pop(best)
        return state, held, reuse

    def pop(self, newest: bool = False) -> tuple[T, list[int]]:
        """The oldest state (or the newest) and its ids, out of the container."""
        return self._kept.pop(-1 if newest else 0)

    def drop(self, n: int) -> list[T]:
        """The n oldest states out of the container (none for n <= 0)."""
        n = max(0, min(n, len(self._kept)))
        gone = [state for state, _held in self._kept[:n]]
        del self._kept[:n]
        return gone
