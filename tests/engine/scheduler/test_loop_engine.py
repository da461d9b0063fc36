"""LocalEngine behaviour on the demo model: stops, limits, cancel, sampling,
usage, errors, the compile cache, IR folders and the torch backend."""

import threading

import pytest

from engine.protocol.messages import GenerateRequest, SamplingParams
from engine.runtime.chat import chat_ids
from engine.runtime.errors import BackendError
from engine.core.interface import EngineError
from engine.scheduler.loop import LocalEngine
from engine_helpers import CONVERSATION, chat, collect, reference_greedy

STORY = chat(("user", "Tell me a story about a robot."))


@pytest.fixture(scope="module")
def demo_path(demo_dir):
    return demo_dir("demo")


@pytest.fixture(scope="module")
def engine(demo_path):
    eng = LocalEngine(demo_path, "demo", precision="f32", context_length=256)
    yield eng
    eng.close()


def req(rid, messages=STORY, **sampling):
    return GenerateRequest(rid, messages=messages, sampling=SamplingParams(**sampling))


def test_info(engine):
    info = engine.info
    assert (info.model_id, info.engine, info.device, info.context_length) == ("demo", "local", "CPU", 256)


def test_max_tokens_ends_with_length_and_usage_counts(engine):
    ids, text, final = collect(engine.generate(req("len", max_tokens=5)))
    assert final.finish_reason == "length" and len(ids) == 5
    assert final.usage.prompt_tokens == len(chat_ids(engine.tokenizer, STORY))
    assert final.usage.completion_tokens == 5
    assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)
    t = final.timings
    assert 0 <= t.queued_s <= t.ttft_s <= t.total_s and t.decode_tok_s > 0


def test_stop_string_truncates_the_answer(engine):
    _, full, _ = collect(engine.generate(req("full", max_tokens=32)))
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"unlucky stop string {stop!r}"
    _, text, final = collect(engine.generate(req("stop", max_tokens=32, stop=(stop,))))
    assert final.finish_reason == "stop"
    assert text == full[:full.index(stop)]


def test_cancel_mid_stream(engine):
    rid = engine.submit(req("cancel", max_tokens=200, ignore_eos=True))
    seen = 0
    for ev in engine.stream(rid, timeout=30):
        seen += len(ev.token_ids)
        if seen == 3:
            engine.cancel(rid)
        final = ev
    assert final.finish_reason == "cancelled"
    assert 3 <= final.usage.completion_tokens < 200


def test_seeded_sampling_is_reproducible(engine):
    def run(rid, seed):
        return collect(engine.generate(req(rid, max_tokens=24, temperature=0.9, top_p=0.95,
                                           top_k=50, seed=seed)))[0]

    a, b, c = run("s1", 42), run("s2", 42), run("s3", 7)
    assert a == b and a != c


def test_raw_prompt(engine, demo_path):
    ids = engine.tokenizer("Once upon a time", add_special_tokens=True)["input_ids"]
    out, _, final = collect(engine.generate(GenerateRequest("raw", prompt="Once upon a time",
                                                            sampling=SamplingParams(max_tokens=8))))
    assert out == reference_greedy(demo_path, ids, 8) and final.usage.prompt_tokens == len(ids)


def test_prompt_longer_than_context_is_an_error(engine):
    _, _, final = collect(engine.generate(req("long", messages=chat(("user", "robot " * 400)))))
    assert final.finish_reason == "error" and "context" in final.error


def test_context_caps_the_answer(engine):
    n_prompt = len(chat_ids(engine.tokenizer, STORY))
    ids, _, final = collect(engine.generate(req("cap", max_tokens=1000, ignore_eos=True)))
    assert final.finish_reason == "length" and len(ids) == 256 - n_prompt


def test_failing_request_does_not_kill_the_engine(engine, monkeypatch):
    real = engine.backend.new_stream

    class Broken:
        past = 0

        def prefill(self, ids):
            raise RuntimeError("boom")

        close = lambda self: None  # noqa: E731

    monkeypatch.setattr(engine.backend, "new_stream", lambda prompt_ids=(): Broken())
    _, _, final = collect(engine.generate(req("boom")))
    assert final.finish_reason == "error" and "boom" in final.error
    monkeypatch.setattr(engine.backend, "new_stream", real)
    assert collect(engine.generate(req("after", max_tokens=3)))[2].finish_reason == "length"


def test_a_scheduler_step_that_raises_ends_its_requests_and_the_engine_serves_on(engine, monkeypatch):
    """A bug in the shared turn (not one request's failure): the running request ends with an
    error naming it, instead of the loop retrying the step forever while its client waits."""
    def broken(active):
        raise RuntimeError("turn bug\nsecond line")

    monkeypatch.setattr(engine, "_turn", broken)
    events = list(engine.stream(engine.submit(req("bug", max_tokens=3)), timeout=60))
    final = events[-1]
    assert final.finish_reason == "error" and final.error_code == "engine"
    assert "turn bug second line" in final.error
    monkeypatch.undo()
    assert collect(engine.generate(req("after-bug", max_tokens=3)))[2].finish_reason == "length"


def test_duplicate_request_id_is_refused(engine):
    rid = engine.submit(req("dup", max_tokens=50))
    with pytest.raises(EngineError):
        engine.submit(req("dup"))
    engine.cancel(rid)
    list(engine.stream(rid, timeout=30))


def test_no_blob_cache_on_cpu_and_ir_folder_input(engine, demo_path, flotilla_cache):
    # CPU compiles straight from the mapped IR: a blob would hold the weights a second
    # time and saves no time there (engine/runtime/ov_compile.py).
    blobs = set((flotilla_cache / "ov").rglob("*.blob"))  # (older Flotillas left some)
    ir_dir = engine.backend.model_dir
    assert (ir_dir / "openvino_model.xml").exists() and ir_dir != demo_path
    exports = sorted(p.name for p in (flotilla_cache / "ov").iterdir())
    with LocalEngine(ir_dir, "demo-ir", precision="f32") as again:  # a second start, from the IR
        assert again.backend.model_dir == ir_dir
        out = collect(again.generate(req("ir", messages=chat(*CONVERSATION), max_tokens=16)))[0]
    assert sorted(p.name for p in (flotilla_cache / "ov").iterdir()) == exports  # nothing re-exported
    assert set((flotilla_cache / "ov").rglob("*.blob")) == blobs, "a start on CPU wrote a compiled blob"
    ids = chat_ids(engine.tokenizer, chat(*CONVERSATION))
    assert out == reference_greedy(demo_path, ids, 16)


def test_close_ends_running_requests_with_error(demo_path):
    eng = LocalEngine(demo_path, "demo", precision="f32")
    rid = eng.submit(req("run", max_tokens=4000, ignore_eos=True))
    it = eng.stream(rid, timeout=30)
    next(it)
    closer = threading.Thread(target=eng.close)
    closer.start()
    final = list(it)[-1]
    closer.join(timeout=30)
    assert final.finish_reason == "error"
    with pytest.raises(EngineError):
        eng.submit(req("late"))


def test_torch_backend_matches_reference(demo_path):
    with LocalEngine(demo_path, "demo", backend="torch") as eng:
        messages = chat(*CONVERSATION)
        out = collect(eng.generate(req("t", messages=messages, max_tokens=12)))[0]
        assert out == reference_greedy(demo_path, chat_ids(eng.tokenizer, messages), 12)


def test_bad_device_and_options(demo_path):
    with pytest.raises(BackendError, match="not available"):
        LocalEngine(demo_path, "demo", device="NPU7")
    with pytest.raises(BackendError, match="precision"):
        LocalEngine(demo_path, "demo", precision="f8")
    with pytest.raises(ValueError, match="backend"):
        LocalEngine(demo_path, "demo", backend="onnx")


def test_from_spec_resolves_a_demo_id():
    with LocalEngine.from_spec("demo", precision="f32") as eng:
        assert eng.info.model_id == "demo"
        assert collect(eng.generate(req("spec", max_tokens=2)))[2].finish_reason in ("length", "stop")
