"""Verification rules: exact greedy acceptance, and speculative sampling
reproducing the target's distribution (chi-square on a tiny vocabulary)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from engine.speculative.verify import greedy_accept, speculative_sample

V = 6  # tiny vocabulary


def test_greedy_accept_takes_the_matching_prefix_and_one_target_token():
    assert greedy_accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert greedy_accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # second rejected: the target's token
    assert greedy_accept([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert greedy_accept([], [3]) == [3]  # no draft: a plain decode step
    with pytest.raises(ValueError):
        greedy_accept([1, 2], [1, 2])


def _chains(seed: int):
    """A target and a draft Markov chain over V tokens (rows: P(next | prev))."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(V, 0.7), size=V)
    q = 0.5 * p + 0.5 * rng.dirichlet(np.full(V, 0.7), size=V)  # a draft that roughly agrees
    return p, q


def _generate(P, Q, first: int, k: int, n_tokens: int, rng, deterministic: bool) -> list[int]:
    """Speculative generation of n_tokens after `first`, the draft drawing from Q
    (or proposing Q's argmax, a deterministic draft like prompt lookup)."""
    out = []
    prev = first
    while len(out) < n_tokens:
        drafts, q_rows, t = [], [], prev
        for _ in range(k):
            if deterministic:
                d = int(np.argmax(Q[t]))
            else:
                d = int(rng.choice(V, p=Q[t]))
                q_rows.append(Q[t])
            drafts.append(d)
            t = d
        ctx = [prev, *drafts]
        p_rows = np.stack([P[c] for c in ctx])  # [k+1, V]: the target after each position
        got = speculative_sample(drafts, p_rows, None if deterministic else np.stack(q_rows), rng)
        out += got
        prev = out[-1]
    return out[:n_tokens]


@pytest.mark.parametrize("k,deterministic", [(1, False), (3, False), (4, True)])
def test_speculative_sampling_matches_the_target_chain(k, deterministic):
    P, Q = _chains(7)
    rng = np.random.default_rng(1234)
    first, draws = 2, 6000
    counts = np.zeros((V, V))  # joint of the first two generated tokens
    for _ in range(draws):
        a, b = _generate(P, Q, first, k, 2, rng, deterministic)
        counts[a, b] += 1
    expected = (P[first][:, None] * P) * draws  # P(a | first) P(b | a)
    keep = expected.ravel() >= 5
    obs, exp = counts.ravel()[keep], expected.ravel()[keep]
    exp = exp * obs.sum() / exp.sum()
    chi2, pval = stats.chisquare(obs, exp)
    assert pval > 0.001, (chi2, pval)


def test_a_wrong_rule_is_detected():
    """Control: accepting every draft (no rejection) gives the draft's distribution, and the test sees it."""
    P, Q = _chains(7)
    rng = np.random.default_rng(99)
    first, draws = 2, 6000
    counts = np.zeros(V)
    for _ in range(draws):
        counts[int(rng.choice(V, p=Q[first]))] += 1
    chi2, pval = stats.chisquare(counts, P[first] * draws)
    assert pval < 1e-6


def test_sampling_with_identical_distributions_accepts_everything():
    P, _ = _chains(3)
    rng = np.random.default_rng(0)
    drafts = [1, 2, 3]
    p = np.stack([P[0], P[1], P[2], P[3]])
    got = speculative_sample(drafts, p, p[:3].copy(), rng)
    assert got[:3] == drafts and len(got) == 4
