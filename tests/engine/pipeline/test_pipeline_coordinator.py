"""PipelineEngine over a local fleet: planning refusals, cancel, stop strings,
sampling, the CLI, and a killed stage reported by name."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import time

import pytest

pytest.importorskip("openvino")
pytest.importorskip("zmq")

from engine_helpers import chat, collect, reference_greedy  # noqa: E402

from engine.planner.plan import PlanError  # noqa: E402
from engine.protocol.messages import GenerateRequest, SamplingParams  # noqa: E402
from engine.core.interface import EngineError  # noqa: E402

HELLO = chat(("user", "Tell me a story about a robot."))


@pytest.fixture(scope="module")
def engine(demo_dir):
    from engine.local.factory import EngineOptions, open_engine

    demo_dir("demo")
    eng = open_engine("demo", "pipeline", EngineOptions(precision="f32", extra={"stages": 2}))
    yield eng
    eng.close()
    assert all(p.poll() is not None for p in eng.fleet.procs)
    assert not eng.fleet.log_dir.exists(), "a clean run left its temporary log folder behind"


def _ids(engine, messages) -> list[int]:
    from engine.runtime.chat import chat_ids

    return chat_ids(engine.tokenizer, messages)


def test_factory_opens_a_pipeline(engine):
    info = engine.info
    assert (info.engine, info.model_id) == ("pipeline", "demo")
    assert [(s.start, s.end) for s in engine.stages] == [(0, 4), (4, 8)]


def test_plan_that_does_not_fit_is_refused_before_anything_launches(demo_dir, monkeypatch):
    from engine.pipeline import runner

    def no_launch(*_a, **_k):
        raise AssertionError("a process was started for a plan that does not fit")

    monkeypatch.setattr(runner.subprocess, "Popen", no_launch)
    monkeypatch.setattr(runner.LocalFleet, "export", no_launch)
    demo_dir("demo")
    with pytest.raises(PlanError) as e:
        runner.launch_pipeline(runner.FleetConfig(model="demo", stages=2, ram_budget_bytes=100_000_000))
    assert "needs" in str(e.value) and "layers 0–4" in str(e.value)
    with pytest.raises(PlanError, match="stage 1 starts at layer 4 but stage 0 ends at 3"):
        runner.launch_pipeline(runner.FleetConfig(model="demo", split=((0, 3), (4, 8))))
    with pytest.raises(PlanError, match="into 9 stages"):
        runner.launch_pipeline(runner.FleetConfig(model="demo", stages=9))


def test_cancel_ends_the_request_and_frees_every_stage(engine):
    rid = engine.submit(GenerateRequest("cancel-me", messages=HELLO, sampling=SamplingParams(max_tokens=2000, ignore_eos=True)))
    events = []
    for ev in engine.stream(rid, timeout=30):
        events.append(ev)
        if len(events) == 3:
            engine.cancel(rid)
    assert events[-1].finish_reason == "cancelled" and events[-1].usage.completion_tokens >= 3
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # pongs arrive every second
        pongs = engine.stage_status()
        if len(pongs) == 2 and all(p.streams == 0 and p.nonce > 2 for p in pongs.values()):
            break
        time.sleep(0.2)
    assert all(p.streams == 0 for p in engine.stage_status().values())


def test_a_coordinator_turn_that_raises_ends_its_requests_and_the_ring_serves_on(engine, monkeypatch):
    """A bug in a turn (here: reading a result) must not leave clients waiting forever: the
    running request ends with the error, its stream is freed on every stage, and the next
    request gets the answer it would have got."""
    real_pick, picks = engine._pick, []

    def pick_that_breaks_once(f, msg, tensors):
        picks.append(f.stream_id)
        if len(picks) == 3:
            raise RuntimeError("injected fault")
        return real_pick(f, msg, tensors)

    monkeypatch.setattr(engine, "_pick", pick_that_breaks_once)
    rid = engine.submit(GenerateRequest("broken", messages=HELLO,
                                        sampling=SamplingParams(max_tokens=200, ignore_eos=True)))
    tokens, _text, final = collect(engine.stream(rid, timeout=30))
    assert (final.finish_reason, final.error_code) == ("error", "engine"), final
    assert final.error == "the engine failed: injected fault" and len(tokens) == 2
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the failed stream is freed, not parked
        pongs = engine.stage_status()
        if len(pongs) == 2 and all(p.streams == len(engine.parked) for p in pongs.values()):
            break
        time.sleep(0.2)
    assert all(p.streams == len(engine.parked) for p in engine.stage_status().values())
    want = reference_greedy(engine.fleet.model_path, _ids(engine, HELLO), 12, ignore_eos=True)
    got = collect(engine.stream(engine.submit(GenerateRequest(
        "after", messages=HELLO, sampling=SamplingParams(max_tokens=12, ignore_eos=True))), timeout=30))[0]
    assert got == want


def test_stop_string_ends_the_answer_before_it(engine):
    ids = _ids(engine, HELLO)
    full = engine.tokenizer.decode(reference_greedy(engine.fleet.model_path, ids, 40), skip_special_tokens=True)
    stop = full[20:24]
    assert stop.strip()
    _tokens, text, final = collect(engine.stream(engine.submit(GenerateRequest(
        "stop", messages=HELLO, sampling=SamplingParams(max_tokens=40, stop=(stop,)))), timeout=30))
    assert final.finish_reason == "stop"
    assert text == full[:full.index(stop)]


def test_sampling_uses_logits_rows_and_matches_the_local_engine(engine):
    from engine.scheduler.loop import LocalEngine

    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_k=50, seed=11)
    penalty = SamplingParams(max_tokens=24, repetition_penalty=1.3)
    got = {}
    for name, s in (("t1", seeded), ("t2", seeded), ("pen", penalty)):
        got[name] = collect(engine.stream(engine.submit(GenerateRequest(name, messages=HELLO, sampling=s)),
                                          timeout=30))[0]
    assert got["t1"] == got["t2"] and len(got["t1"]) == 24  # the seed fixes the draws
    local = LocalEngine(engine.fleet.model_path, "demo", backend="torch")
    try:
        want = collect(local.stream(local.submit(GenerateRequest("pen", messages=HELLO, sampling=penalty))))[0]
    finally:
        local.close()
    assert got["pen"] == want


def test_refused_prompt_ends_with_an_error_event(engine):
    ids, _text, final = collect(engine.stream(engine.submit(GenerateRequest("empty", prompt="")), timeout=10))
    assert final.finish_reason in ("error", "stop", "length")  # BOS-less tokenizers give no ids


def test_cli_answers_one_prompt(demo_dir, capsys):
    from engine.cli import pipeline_cmd

    parser = argparse.ArgumentParser()
    pipeline_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["pipeline", "--model", "demo", "--split", "0:5,5:8", "--exact",
                              "-p", "Hello there", "--max-tokens", "8"])
    assert args.func(args) == 0
    err = capsys.readouterr().err
    assert "stage 1 (layers 5–8" in err and "tok/s" in err


def test_killed_stage_is_reported_by_name_within_5s(demo_dir):
    from engine.pipeline.runner import FleetConfig, launch_pipeline

    eng = launch_pipeline(FleetConfig(model="demo", stages=3, exact=True, recover=False))  # the no-recovery path
    try:
        victim = eng.stages[1]
        rids = [eng.submit(GenerateRequest(f"k{i}", messages=HELLO, sampling=SamplingParams(max_tokens=3000, ignore_eos=True)))
                for i in range(2)]
        streams = [eng.stream(r, timeout=10) for r in rids]
        for s in streams:
            next(s)  # both are generating
        os.kill(victim.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        finals = []
        for s in streams:
            for ev in s:
                if ev.final:
                    finals.append((ev, time.monotonic() - t0))
        want = f"stage 1 (layers 3–6, pid {victim.proc.pid}) exited with signal 9"
        for ev, elapsed in finals:
            assert ev.finish_reason == "error" and want in ev.error, ev
            assert elapsed < 5.0
        with pytest.raises(EngineError, match="exited with signal 9"):
            eng.submit(GenerateRequest("after", messages=HELLO))
    finally:
        eng.close()
    assert all(p.poll() is not None for p in eng.fleet.procs), "close() left stage processes behind"
    # the stage that died keeps the log its error names; the test cleans it up
    assert (eng.fleet.log_dir / "stage-1.log").is_file()
    shutil.rmtree(eng.fleet.log_dir)


def test_a_stage_that_fails_to_load_is_named_and_nothing_is_left(demo_dir, monkeypatch, tmp_path):
    from types import SimpleNamespace

    from engine.pipeline import runner

    monkeypatch.setattr(runner.LocalFleet, "export",
                        lambda self: [SimpleNamespace(path=str(tmp_path / f"missing-{i}")) for i in range(2)])
    started = []
    real_popen = runner.subprocess.Popen

    def popen(*a, **k):
        started.append(real_popen(*a, **k))
        return started[-1]

    monkeypatch.setattr(runner.subprocess, "Popen", popen)
    with pytest.raises(EngineError, match=r"stage \d \(layers \d–\d, pid \d+\) exited with code 1"):
        runner.launch_pipeline(runner.FleetConfig(model="demo", stages=2, ready_timeout_s=60, log_dir=tmp_path))
    assert len(started) == 2 and all(p.poll() is not None for p in started)


def test_a_stage_of_another_protocol_version_fails_at_once(tmp_path):
    """A worker from another Flotilla release is named within seconds, not after the
    whole ready timeout (the coordinator and workers of one ring must match)."""
    import threading
    import time

    import msgpack
    import zmq

    from engine.models.demo import ensure_demo
    from engine.pipeline.coordinator import PipelineConfig, PipelineEngine, StageLink
    from engine.protocol.version import PROTOCOL_VERSION
    from engine.core.interface import EngineError

    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)  # a "worker" that answers every message in a future protocol
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if fake.poll(50):
                ident, *_ = fake.recv_multipart()
                fake.send_multipart([ident, msgpack.packb({"v": PROTOCOL_VERSION + 1, "k": "stage_pong", "b": {}})])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    started = time.monotonic()
    try:
        with pytest.raises(EngineError, match="another Flotilla protocol"):
            PipelineEngine([StageLink(0, 0, 8, f"tcp://127.0.0.1:{port}")], ensure_demo("demo"), "demo",
                           PipelineConfig(ready_timeout_s=60))
        assert time.monotonic() - started < 30
    finally:
        stop.set()
        t.join()
        fake.close(0)
        ctx.term()
