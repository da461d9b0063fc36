"""Which kept KV state a new prompt can start from: the one rule of prompt caching.

An engine keeps the KV state of finished answers (the local engine on its idle
InferRequests, the pipeline as parked streams on every stage), each with the token
ids it holds. A new prompt takes the one sharing the longest prefix with it: at least
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

import numpy as np

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
