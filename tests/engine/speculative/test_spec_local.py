"""LocalEngine with speculation: greedy answers token-identical to plain greedy
(both draft kinds, K = 1..8, two interleaved requests, with and without KV
compaction), and seeded sampling distributed like the target's."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("openvino")

from spec_helpers import DRAFT_SIGMA, PROMPTS, run_pair  # noqa: E402

from engine.protocol.messages import GenerateRequest, SamplingParams, SpeculativeParams  # noqa: E402


@pytest.fixture(scope="module")
def engines(demo_dir):
    from engine.scheduler.loop import LocalEngine
    from engine.speculative.config import SpecConfig
    from engine.speculative.synthetic import noisy_draft

    path = demo_dir("demo")
    draft = noisy_draft(path, DRAFT_SIGMA)
    plain = LocalEngine(path, "demo", precision="f32", speculative=SpecConfig(draft_model=str(draft)))
    # compaction on almost every rejection: the physical trim path must be exact too
    eager = LocalEngine(path, "demo", precision="f32",
                        speculative=SpecConfig(draft_model=str(draft), compact_fraction=0.01, compact_min_hidden=1))
    yield plain, eager
    plain.close()
    eager.close()


@pytest.fixture(scope="module")
def baseline(engines):
    return [ids for ids, _ in run_pair(engines[0], "base", None)]


@pytest.mark.parametrize("mode", ["lookup", "draft"])
def test_greedy_is_identical_for_every_k(engines, baseline, mode):
    plain, eager = engines
    steps = []
    for k in range(1, 9):
        for name, eng in (("plain", plain), ("eager", eager)):
            if name == "eager" and k not in (2, 5, 8):
                continue
            got = run_pair(eng, f"{mode}-{name}-{k}", SpeculativeParams(mode, k, adaptive=False))
            assert [ids for ids, _ in got] == baseline, (mode, name, k)
            steps.append(sum(n for _, n in got))
    if mode == "draft":  # drafts were accepted (fewer events than tokens) and rejected: rollback ran
        assert min(steps) < 2 * len(baseline[0])
    assert eager.spec is not None


def test_adaptive_k_is_identical(engines, baseline):
    got = run_pair(engines[0], "adaptive", SpeculativeParams("draft", 4))
    assert [ids for ids, _ in got] == baseline
    got = run_pair(engines[0], "adaptive-l", SpeculativeParams("lookup"))
    assert [ids for ids, _ in got] == baseline


def test_sampled_tokens_follow_the_target_distribution(engines):
    """Two-sample chi-square: the 2nd and 3rd tokens (from verify steps) of seeded
    requests with and without speculation (top-k 3 keeps the table small)."""
    from scipy import stats

    eng = engines[0]
    n = 300

    def draws(spec, tag):
        out = []
        for lo in range(0, n, 100):  # the engine queues at most 256 requests
            ids = [eng.submit(GenerateRequest(f"{tag}{i}", messages=PROMPTS[0], speculative=spec,
                                              sampling=SamplingParams(max_tokens=3, temperature=1.5, top_k=3,
                                                                      seed=i)))
                   for i in range(lo, min(n, lo + 100))]
            for rid in ids:
                toks = [t for e in eng.stream(rid, timeout=60) for t in e.token_ids]
                out.append(tuple(toks[1:3]))
        return out

    plain = draws(SpeculativeParams("off"), "p")
    spec = draws(SpeculativeParams("draft", 2, adaptive=False), "s")
    cells = sorted(set(plain) | set(spec))
    table = np.array([[plain.count(c) for c in cells], [spec.count(c) for c in cells]])
    table = table[:, table.sum(axis=0) >= 10]  # pool sparse cells away
    chi2, pval, _dof, _exp = stats.chi2_contingency(table)
    assert pval > 0.001, (chi2, pval, table)
