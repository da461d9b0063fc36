"""Pipelines of 1-4 stage processes equal transformers greedy, with interleaved streams.

Each fleet is started once per (model, stages) with f32 hints (exact=True);
four chat requests of different prompt lengths are submitted at once, so
their steps interleave in the ring, and each answer must equal its own
transformers generate(do_sample=False) reference over 64 tokens.
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("openvino")
pytest.importorskip("zmq")
torch = pytest.importorskip("torch")

from engine_helpers import chat, collect, reference_greedy  # noqa: E402

from engine.protocol.messages import GenerateRequest, SamplingParams  # noqa: E402

TOKENS = 64
CONVERSATIONS = (
    (("user", "Hi"),),
    (("user", "Tell me a story about a robot who learns to paint the sea."),),
    (("system", "You are a helpful assistant."), ("user", "What is the weather like on the lake today?")),
    (("system", "You are terse."), ("user", "Name three birds."), ("assistant", "Gulls, crows, owls."),
     ("user", "And three fish that live in cold northern rivers, please?")),
)
LAYERS = {"demo": 8, "demo-moe": 4}
CASES = [(m, n) for m in ("demo", "demo-moe") for n in (1, 2, 3, 4)]


@pytest.fixture(scope="module")
def references(demo_dir):
    """model -> [(templated ids, reference tokens)] for every conversation."""
    from transformers import AutoTokenizer

    from engine.runtime.chat import chat_ids

    out = {}
    for model in LAYERS:
        path = demo_dir(model)
        tok = AutoTokenizer.from_pretrained(str(path))
        rows = []
        for conv in CONVERSATIONS:
            ids = chat_ids(tok, chat(*conv))
            rows.append((ids, reference_greedy(path, ids, TOKENS)))
        out[model] = rows
    lengths = [len(ids) for ids, _ in out["demo"]]
    assert len(set(lengths)) == len(lengths), "prompts must differ in length"
    return out


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{n}stages" for m, n in CASES])
def fleet(request, demo_dir):
    from engine.pipeline.runner import FleetConfig, launch_pipeline

    model, stages = request.param
    demo_dir(model)
    engine = launch_pipeline(FleetConfig(model=model, stages=stages, exact=True, max_concurrent=4))
    yield model, stages, engine
    engine.close()
    assert all(p.poll() is not None for p in engine.fleet.procs), "stage processes outlived close()"


def test_interleaved_streams_equal_transformers_greedy(fleet, references):
    model, stages, engine = fleet
    assert len(engine.stages) == stages
    assert [(s.start, s.end) for s in engine.stages][-1][1] == LAYERS[model]
    requests = [GenerateRequest(f"{model}-{stages}-{i}", messages=chat(*conv),
                                sampling=SamplingParams(max_tokens=TOKENS))
                for i, conv in enumerate(CONVERSATIONS)]
    ids = [engine.submit(r) for r in requests]  # all in the ring at once
    results: dict[str, tuple] = {}

    def drain(rid: str) -> None:
        results[rid] = collect(engine.stream(rid, timeout=60))

    threads = [threading.Thread(target=drain, args=(rid,)) for rid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for rid, (prompt, want) in zip(ids, references[model]):
        got, _text, final = results[rid]
        assert final.finish_reason in ("length", "stop"), final
        assert final.usage.prompt_tokens == len(prompt)
        assert got == want, f"{rid}: pipeline tokens differ from transformers"
    # Every stage computed every stream's steps: prompt chunk + one per further token.
    steps = sum(1 + len(want) - 1 for _p, want in references[model])
    assert engine.stats.steps >= steps
    assert all(ms > 0 for ms in engine.stats.stage_ms)


def test_logprobs_over_the_ring_are_transformers_log_softmax(fleet, references, demo_dir):
    """Greedy with logprobs: the coordinator asks the last stage for the logits row and takes
    each token's logprob from it; they equal transformers' teacher-forced log-softmax."""
    from engine_helpers import reference_model

    model, stages, engine = fleet
    prompt, want = references[model][1]
    n = min(8, len(want))
    req = GenerateRequest(f"{model}-{stages}-lp", messages=chat(*CONVERSATIONS[1]),
                          sampling=SamplingParams(max_tokens=n, logprobs=3))
    events = list(engine.stream(engine.submit(req), timeout=60))
    got = [t for e in events for t in e.token_ids]
    lps = [lp for e in events for lp in e.logprobs]
    assert got == want[:n] and [lp.token_id for lp in lps] == got
    with torch.inference_mode():
        logits = reference_model(demo_dir(model))(input_ids=torch.tensor([prompt + got])).logits[0].double()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + n]
    for pos, lp in enumerate(lps):
        assert lp.logprob == pytest.approx(float(ref[pos, lp.token_id]), abs=2e-3)
        assert len(lp.top_ids) == 3 and lp.top_ids[0] == lp.token_id  # greedy: the pick is the likeliest
        for t, v in zip(lp.top_ids, lp.top_logprobs):  # the likeliest three (up to float noise)
            assert v == pytest.approx(float(ref[pos, t]), abs=2e-3)
            assert v >= float(torch.topk(ref[pos], 3).values[-1]) - 2e-3
