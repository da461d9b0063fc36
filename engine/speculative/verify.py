"""Verification of drafted tokens: exact greedy, and speculative sampling.

Notation: the target ran [pending, d1 .. dk] in one step; row j of its output
(j = 0..k) is its prediction for the token after d_j (d_0 = pending).

Greedy: accept d_{j+1} while it equals the target's argmax of row j; the
first mismatch (or, all accepted, row k) gives one more token for free. The
answer is token-identical to greedy decoding without speculation.

Sampling (Leviathan et al. 2023; Chen et al. 2023): with target
probabilities p_j and draft probabilities q_j (the distribution d_{j+1} was
drawn from), accept d_{j+1} with probability min(1, p_j(d) / q_j(d));
otherwise draw the next token from norm(max(p_j - q_j, 0)) and stop. All
accepted: draw from p_k. Each emitted token is then distributed exactly as
the target's. A deterministic draft (prompt lookup) has q_j = one-hot(d).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def greedy_accept(drafts: Sequence[int], target: Sequence[int]) -> list[int]:
    """Tokens to emit: the accepted drafts, then the target's own next token.

    target[j] = the target's argmax after d_0..d_j; len(target) == len(drafts) + 1."""
    if len(target) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target tokens, got {len(target)}")
    out = []
    for j, d in enumerate(drafts):
        if int(target[j]) != int(d):
            out.append(int(target[j]))
            return out
        out.append(int(d))
    out.append(int(target[len(drafts)]))
    return out


def draw_from(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a (possibly unnormalised) distribution [V], by inverse CDF."""
    cdf = np.cumsum(probs, dtype=np.float64)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), probs.shape[0] - 1))


def residual(p: np.ndarray, q: np.ndarray | None, d: int) -> np.ndarray:
    """norm(max(p - q, 0)) as an unnormalised row; q None = one-hot(d)."""
    if q is None:
        r = p.copy()
        r[d] = 0.0
    else:
        r = np.maximum(p - q, 0.0)
    if r.sum() <= 0.0:  # p == q exactly (numerically): any p-draw is right
        return p
    return r


def speculative_sample(drafts: Sequence[int], p: np.ndarray, q: np.ndarray | None,
                       rng: np.random.Generator) -> list[int]:
    """Tokens to emit under the rejection-sampling rule.

    p: target probabilities float [k+1, V]; q: draft probabilities [k, V]
    (None: a deterministic draft, q_j = one-hot(d_{j+1}))."""
    k = len(drafts)
    if p.shape[0] != k + 1 or (q is not None and q.shape[0] != k):
        raise ValueError("p needs k+1 rows and q k rows")
    out = []
    for j, d in enumerate(drafts):
        d = int(d)
        pd = float(p[j, d])
        qd = 1.0 if q is None else float(q[j, d])
        if qd <= 0.0:
            qd = 1e-30  # drawn from q, so q(d) > 0 unless rounded away: then always test p
        if rng.random() < min(1.0, pd / qd):
            out.append(d)
            continue
        out.append(draw_from(residual(p[j], None if q is None else q[j], d), rng))
        return out
    out.append(draw_from(p[k], rng))
    return out
