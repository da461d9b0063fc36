"""The cache budget rule shared by the engines that serve a model from storage (MoE, sparse).

A budget is decided once the resident weights are loaded, from `room` -- the RAM this
process may still take (engine.platform.memory.memory_room: free RAM, or what its memory
cgroup's limit leaves) -- minus the KV reserve (context x concurrent requests, reserved up
front but not yet touched), the working memory of one pass, and CODE_RESIDENT_BYTES for the
process's own code. No budget given: all that is left, at most the whole store. A budget
below the minimum (one layer's active set) or above what is left is refused with the
numbers, never trimmed silently.
"""

from __future__ import annotations

MB = 1e6

# The file-backed pages the process's own code (Python, torch, numpy, OpenVINO libraries)
# must keep resident. `room` cannot see them when the budget is decided: after building a
# store and calibrating under a cap they have been evicted, so they look free -- and a cache
# that takes them makes the process page its own code in and out for every token. Measured:
# the sparse engine at steady state holds 136-145 MB RssFile (tests/e2e/test_sparse_under_cgroup's
# model, uncapped); under a cap without this term it slowed from 1.5 minutes to over 18.
CODE_RESIDENT_BYTES = 150_000_000


class BudgetError(ValueError):
    """The cache budget cannot work: below the minimum, or more than fits."""


def fit_budget(requested: int | None, minimum: int, everything: int, room: int, kv_bytes: int, working: int,
               what: str = "cache") -> int:
    """The budget in bytes (see the module text); BudgetError with both numbers otherwise."""
    left = room - kv_bytes - working - CODE_RESIDENT_BYTES
    parts = (f"{room / MB:.0f} MB free after the resident weights, minus {kv_bytes / MB:.0f} MB KV reserve, "
             f"{working / MB:.0f} MB working memory and {CODE_RESIDENT_BYTES / MB:.0f} MB for code, "
             f"leaves {max(left, 0) / MB:.0f} MB")
    if requested is None:
        budget = min(everything, left)
        if budget < minimum:
            raise BudgetError(f"no room for the {what}: {parts}; it needs at least {minimum / MB:.1f} MB "
                              "(lower the context or concurrent requests, or free memory)")
        return int(budget)
    if requested < minimum:
        raise BudgetError(f"{what} budget {requested / MB:.1f} MB is below the minimum of {minimum / MB:.1f} MB "
                          f"(one layer's working set); all of it takes {everything / MB:.1f} MB")
    if requested > left:
        raise BudgetError(f"{what} budget {requested / MB:.0f} MB does not fit: {parts}")
    return int(requested)
