import numpy as np
import pytest

from engine.protocol.messages import SamplingParams
from engine.runtime.sampling import (Sampler, SamplerConfig, apply_repetition_penalty, apply_top_k,
                                     apply_top_p, draw, process_logits, softmax)

NEG = -np.inf


def test_greedy_is_argmax_first_on_ties():
    s = Sampler(SamplerConfig())
    assert s.sample(np.array([1.0, 3.0, 3.0, -2.0], np.float32)) == 1


def test_repetition_penalty_ctrl_rule():
    logits = np.array([2.0, -2.0, 1.0, 4.0], np.float32)
    out = apply_repetition_penalty(logits, np.array([0, 1, 1]), 2.0)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, 4.0])
    assert logits[0] == 2.0  # input untouched


def test_repetition_penalty_changes_the_greedy_pick():
    # token 0 (seen in the prompt) would win, but 3.0/2 < 2.0
    s = Sampler(SamplerConfig(repetition_penalty=2.0), prompt_ids=[0])
    assert s.sample(np.array([3.0, 2.0, 0.0], np.float32)) == 1
    # then token 1 is seen too: 3.0/2 = 1.5 and 2.0/2 = 1.0 < 1.6
    assert s.sample(np.array([3.0, 2.0, 1.6], np.float32)) == 2


def test_top_k_keeps_k_largest():
    out = apply_top_k(np.array([1.0, 5.0, 3.0, 4.0], np.float32), 2)
    np.testing.assert_array_equal(out, [NEG, 5.0, NEG, 4.0])
    assert apply_top_k(np.array([1.0, 2.0]), 0).tolist() == [1.0, 2.0]


def test_top_p_keeps_smallest_set_reaching_p():
    # probabilities 0.5, 0.25, 0.125, 0.125
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.125])).astype(np.float32)
    out = apply_top_p(logits, 0.7)  # 0.5 < 0.7, 0.5+0.25 >= 0.7 -> keep two
    assert np.isfinite(out).tolist() == [True, True, False, False]
    out = apply_top_p(logits, 0.5)  # the first alone reaches 0.5
    assert np.isfinite(out).tolist() == [True, False, False, False]
    out = apply_top_p(logits, 0.01)  # always at least one
    assert np.isfinite(out).sum() == 1


def test_temperature_scales_logits():
    cfg = SamplerConfig(temperature=2.0)
    np.testing.assert_allclose(process_logits(np.array([2.0, 4.0], np.float32), np.zeros(0, int), cfg),
                               [1.0, 2.0])


def test_softmax_and_draw_follow_the_distribution():
    logits = np.log(np.array([0.2, 0.8]))
    np.testing.assert_allclose(softmax(logits), [0.2, 0.8])
    rng = np.random.default_rng(0)
    picks = [draw(logits, rng) for _ in range(4000)]
    assert 0.75 < np.mean(picks) < 0.85
    assert draw(np.array([NEG, 0.0, NEG]), rng) == 1


def test_seeded_sampling_is_reproducible():
    rng = np.random.default_rng(7)
    steps = [rng.normal(size=50).astype(np.float32) for _ in range(40)]
    p = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.1, seed=1234)

    def run(params):
        s = Sampler(SamplerConfig.from_params(params), prompt_ids=[1, 2, 3])
        return [s.sample(x) for x in steps]

    assert run(p) == run(p)
    other = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.1, seed=99)
    assert run(p) != run(other)


@pytest.mark.parametrize("k", [1, 3])
def test_top_k_one_is_greedy(k):
    x = np.array([0.1, 2.0, 1.9, -1.0], np.float32)
    s = Sampler(SamplerConfig(temperature=1.0, top_k=k, seed=0))
    picks = {s.sample(x) for _ in range(50)}
    assert picks == {1} if k == 1 else picks <= {1, 2, 0}
