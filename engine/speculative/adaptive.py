"""Adaptive K: pick the draft length from the running acceptance rate.

Model (Leviathan et al.): each draft token is accepted with probability a,
independently, until the first rejection. A step with K drafts then emits
E(K) = (1 - a^(K+1)) / (1 - a) tokens and costs 1 + c*K target-step units,
c = (draft time per token + verify time per extra token) / verify step time.
K = argmax E(K)/cost(K) over 1..k_max. `a` is estimated from exponentially
decayed counts of accepted drafts and of trials (a rejection is one trial,
an accepted draft one success and one trial), `c` from measured times.
"""

from __future__ import annotations

DECAY = 0.85  # weight of the past per step (about the last 7 steps count)
PRIOR_ACCEPT = 0.6  # acceptance rate assumed before any step
PRIOR_WEIGHT = 2.0  # ... worth this many trials
VERIFY_PER_TOKEN = 0.04  # extra verify cost per drafted token, in target steps (memory-bound decode)


def expected_tokens(a: float, k: int) -> float:
    """Tokens one step emits with k drafts at per-token acceptance a."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class AdaptiveK:
    def __init__(self, k: int, k_max: int, adaptive: bool = True) -> None:
        self.k_fixed = k  # used when not adaptive
        self.k_max = max(k, k_max)
        self.adaptive = adaptive
        self.successes = PRIOR_ACCEPT * PRIOR_WEIGHT  # decayed accepted drafts
        self.trials = PRIOR_WEIGHT  # decayed accept/reject tests
        self.draft_ms = 0.0  # EMA of draft time per drafted token
        self.step_ms = 0.0  # EMA of a verify step's time
        self._k = k
        self.proposed_total = 0  # drafted tokens (all steps)
        self.accepted_total = 0  # of which accepted
        self.rejections_total = 0  # steps that ended on a rejected draft

    @property
    def acceptance(self) -> float:
        return self.successes / self.trials if self.trials else PRIOR_ACCEPT

    @property
    def k(self) -> int:
        return self._k if self.adaptive else self.k_fixed

    def update(self, proposed: int, accepted: int, draft_ms: float = 0.0, step_ms: float = 0.0) -> None:
        """After a step: `accepted` of `proposed` drafts were taken."""
        if proposed <= 0:
            return
        self.proposed_total += proposed
        self.accepted_total += accepted
        rejected = 1 if accepted < proposed else 0
        self.rejections_total += rejected
        self.successes = self.successes * DECAY + accepted
        self.trials = self.trials * DECAY + accepted + rejected
        if draft_ms > 0:
            per = draft_ms / proposed
            self.draft_ms = per if self.draft_ms == 0 else 0.8 * self.draft_ms + 0.2 * per
        if step_ms > 0:
            self.step_ms = step_ms if self.step_ms == 0 else 0.8 * self.step_ms + 0.2 * step_ms
        self._k = self.best_k()

    def cost_per_draft(self) -> float:
        c = VERIFY_PER_TOKEN
        if self.step_ms > 0:
            c += self.draft_ms / self.step_ms
        return c

    def best_k(self) -> int:
        a = min(self.acceptance, 0.999)
        c = self.cost_per_draft()
        return max(range(1, self.k_max + 1), key=lambda k: expected_tokens(a, k) / (1.0 + c * k))
