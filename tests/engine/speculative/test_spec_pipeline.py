"""Speculation over 2- and 3-stage pipelines: greedy answers token-identical to
plain greedy for both draft kinds, K = 1..8, two interleaved streams; KV
compaction through the stages; sampling runs with logits rows."""

from __future__ import annotations

import pytest

pytest.importorskip("openvino")
pytest.importorskip("zmq")

from spec_helpers import DRAFT_SIGMA, run_pair  # noqa: E402

from engine.protocol.messages import GenerateRequest, SamplingParams, SpeculativeParams  # noqa: E402


@pytest.fixture(scope="module", params=[2, 3], ids=["2stages", "3stages"])
def ring(request, demo_dir):
    from engine.pipeline.runner import FleetConfig, launch_pipeline
    from engine.speculative.config import SpecConfig
    from engine.speculative.synthetic import noisy_draft

    path = demo_dir("demo")
    draft = noisy_draft(path, DRAFT_SIGMA)
    # 3 stages: compaction on almost every rejection (the stages' physical compaction must be exact)
    spec = (SpecConfig(draft_model=str(draft)) if request.param == 2 else
            SpecConfig(draft_model=str(draft), compact_fraction=0.01, compact_min_hidden=1))
    eng = launch_pipeline(FleetConfig(model="demo", stages=request.param, exact=True), speculative=spec)
    baseline = [ids for ids, _ in run_pair(eng, "base", None)]
    yield eng, baseline
    eng.close()


@pytest.mark.parametrize("mode", ["lookup", "draft"])
def test_greedy_is_identical_over_the_ring(ring, mode):
    eng, baseline = ring
    events = []
    for k in range(1, 9):
        got = run_pair(eng, f"{mode}-{k}", SpeculativeParams(mode, k, adaptive=False))
        assert [ids for ids, _ in got] == baseline, (mode, k)
        events.append(sum(n for _, n in got))
    if mode == "draft":  # drafts were accepted (fewer events than tokens) and rejected: rollback ran
        assert min(events) < 2 * len(baseline[0])
    got = run_pair(eng, f"{mode}-adaptive", SpeculativeParams(mode))
    assert [ids for ids, _ in got] == baseline


def test_compaction_reached_the_stages(ring):
    eng, baseline = ring
    run_pair(eng, "compact", SpeculativeParams("draft", 6, adaptive=False))
    pongs = eng.stage_status()
    assert all(p.errors == 0 for p in pongs.values())


def test_sampling_over_the_ring_is_seeded(ring):
    eng, _ = ring
    s = SamplingParams(max_tokens=24, temperature=0.8, top_k=50, seed=5)
    spec = SpeculativeParams("draft", 3, adaptive=False)
    a, b = (run_pair_one(eng, f"samp{i}", s, spec) for i in range(2))
    assert a == b and 1 <= len(a) <= 24


def run_pair_one(eng, rid, sampling, spec):
    from engine_helpers import chat

    events = list(eng.stream(eng.submit(GenerateRequest(rid, messages=chat(("user", "Hello there")),
                                                        sampling=sampling, speculative=spec)), timeout=60))
    assert events[-1].finish_reason in ("stop", "length"), events[-1].error
    return [t for e in events for t in e.token_ids]
