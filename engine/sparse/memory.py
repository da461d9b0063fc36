"""Free-RAM watching: the neuron cache shrinks when the PC needs its memory
back and grows again (up to the user's budget) when it is free.

The governor only proposes a budget; the engine applies it between layers,
where resizing the cache cannot change any output (kept rows stay, dropped
ones are simply read again when needed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from engine.platform.memory import available_ram  # the whole PC's free RAM (not a cgroup's)


def process_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


@dataclass
class MemoryPolicy:
    reserve_bytes: int = 512 * 2**20  # keep at least this much RAM free for the rest of the PC
    check_every_s: float = 0.5  # how often free RAM is looked at (a syscall; cheap but not free)
    adapt: bool = True  # False = keep the user's budget whatever happens
    available: Callable[[], int] = available_ram  # free-RAM probe (tests inject a fake one)


class BudgetGovernor:
    def __init__(self, user_budget: int, min_budget: int, policy: MemoryPolicy) -> None:
        self.user_budget = int(user_budget)  # the most we may use (set by the user / API)
        self.min_budget = int(min_budget)  # one layer's active set: never below
        self.policy = policy
        self._last = 0.0

    def propose(self, current: int, now: float | None = None) -> int | None:
        """A new budget for a cache of `current` bytes, or None to keep it."""
        want = min(current, self.user_budget)
        if not self.policy.adapt:
            want = self.user_budget
        else:
            now = time.monotonic() if now is None else now
            if now - self._last >= self.policy.check_every_s:
                self._last = now
                spare = self.policy.available() - self.policy.reserve_bytes
                # short of RAM: give back the deficit; room to spare: grow toward the user's budget
                want = min(current + spare, self.user_budget)
        want = max(want, self.min_budget)
        return None if want == current else int(want)
