"""Graceful yield and recovery on a real fleet: loopback agents, real shard workers, CURVE.

Three agents; a 2-stage pipeline of `demo` uses two of them, the third is a
spare. Checked:
- the owner of the PC running stage 1 comes back while streams are in flight:
  the agent announces "yielding", the coordinator migrates stage 1 onto the
  spare (shard sent, worker loaded, ring re-wired, streams replayed); every
  stream completes with exactly the tokens of an uninterrupted greedy run
  (f32; the same ring with nobody leaving), stage 1 now runs on the spare, and the yielding agent's worker is
  gone within 2 s of the user's return;
- with no spare agent and this PC not allowed to host a stage, the same
  yield ends every stream with an error event naming the reason; the tokens
  already streamed are kept (a prefix of the greedy answer).
"""

from __future__ import annotations

import threading
import time

import psutil
import pytest

pytest.importorskip("openvino")
pytest.importorskip("torch")

from engine_helpers import chat, reference_greedy  # noqa: E402
from fleet_helpers import paired_agents, set_idle  # noqa: E402

from engine.fleet.launch import launch_fleet  # noqa: E402
from engine.fleet.launch_config import LaunchConfig  # noqa: E402
from engine.protocol.messages import GenerateRequest, SamplingParams  # noqa: E402

TOKENS = 400
# Long answers whatever the random weights say: the owner must return while every stream runs.
LONG = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
CFG = LaunchConfig(model="demo", stages=2, exact=True, max_concurrent=4, device_preference=("CPU",),
                   controller_host="127.0.0.1", recover=True, local_fallback=False)
CONVS = [chat(("user", "Tell me about the sea.")),
         chat(("system", "You are terse."), ("user", "Name three birds that live near cold rivers.")),
         chat(("user", "Write a long story about a lighthouse keeper."))]


@pytest.fixture(scope="module")
def agents(tmp_path_factory, demo_dir):
    demo_dir("demo")
    procs, keys, peers = paired_agents(tmp_path_factory.mktemp("recovery"), 3)
    try:
        yield procs, keys, peers
    finally:
        for a in procs:
            a.stop()


@pytest.fixture(scope="module")
def refs(agents, demo_dir):
    """The uninterrupted greedy answers: the same fleet ring (f32, exact) with nobody leaving;
    anchored to transformers greedy on a prefix (the full-length transformers run takes minutes
    on a busy machine; test_fleet_launch.py checks fleet == transformers already)."""
    import dataclasses

    from transformers import AutoTokenizer

    from engine.runtime.chat import chat_ids

    procs, keys, peers = agents
    engine = launch_fleet(keys, peers[:2], dataclasses.replace(CFG, recover=False))
    try:
        out = []
        for i, c in enumerate(CONVS):
            req = GenerateRequest(f"ref{i}", messages=c, sampling=LONG)
            out.append([t for ev in engine.stream(engine.submit(req), timeout=90) for t in ev.token_ids])
    finally:
        engine.close()
    path = demo_dir("demo")
    tok = AutoTokenizer.from_pretrained(str(path))
    assert out[0][:16] == reference_greedy(path, chat_ids(tok, CONVS[0]), 16, ignore_eos=True)
    return out


def _run_streams(engine, tag: str, on_started) -> dict[str, list]:
    """Submit every conversation, call on_started() once each stream has a few tokens; the events."""
    ids = [engine.submit(GenerateRequest(f"{tag}{i}", messages=c, sampling=LONG))
           for i, c in enumerate(CONVS)]
    events: dict[str, list] = {r: [] for r in ids}
    started = {r: threading.Event() for r in ids}

    def drain(rid: str) -> None:
        for ev in engine.stream(rid, timeout=90):
            events[rid].append(ev)
            if sum(len(e.token_ids) for e in events[rid]) >= 4:
                started[rid].set()
        started[rid].set()

    threads = [threading.Thread(target=drain, args=(r,)) for r in ids]
    for t in threads:
        t.start()
    for r in ids:
        started[r].wait(60)
    on_started()
    for t in threads:
        t.join(120)
    return {r: events[r] for r in ids}


def _agent_of(procs, peer):
    return next(a for a in procs if a.public_key == peer.info.public_key)


def _gone_within(pid: int, t0: float, limit: float = 5.0) -> float:
    while time.time() - t0 < limit:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    return time.time() - t0


def test_yield_migrates_the_stage_to_the_spare_agent(agents, refs):
    procs, keys, peers = agents
    engine = launch_fleet(keys, peers, CFG)
    try:
        session = engine.fleet
        ring = [st.peer.node_id for st in session.stages]
        spare = next(p for p in peers if p.node_id not in ring)
        old = session.stages[1]
        agent = _agent_of(procs, old.peer)
        mark: dict[str, float] = {}

        def owner_returns() -> None:
            produced = [len(f.gen.output_ids) for f in getattr(engine, "_active", {}).values()]
            mark["in_flight"] = len(produced)
            mark["t0"] = time.time()
            set_idle(agent.idle_file, 0)  # the owner of stage 1's PC is back
            mark["worker_gone_s"] = _gone_within(old.pid, mark["t0"])

        got = _run_streams(engine, "m", owner_returns)
        assert mark["in_flight"] == len(CONVS), "the streams ended before the owner returned"
        for (rid, evs), ref in zip(got.items(), refs):
            final = evs[-1]
            assert final.finish_reason in ("stop", "length"), (rid, final.error)
            assert [t for ev in evs for t in ev.token_ids] == ref, f"{rid} differs from uninterrupted greedy"
        assert session.stages[1].peer.node_id == spare.node_id, "stage 1 is not on the spare agent"
        assert session.stages[0].peer.node_id == ring[0]
        assert mark["worker_gone_s"] < 2.0, f"the yielding agent's worker lived {mark['worker_gone_s']:.2f} s"
        recs = [r for r in engine.recovery.records if r.ok]
        # (a stream that reached its end of text before the hand-over is not replayed)
        assert recs and recs[0].graceful and recs[0].lost == (1,) and recs[0].streams >= 2
        yielded = [ln for ln in agent.lines if "yielded to the local user" in ln]
        rep = session.provider.replacements[0]
        summary = session.summary()
        print(f"\nyield -> migration onto the spare: worker gone {mark['worker_gone_s']:.2f} s after the user "
              f"returned; replacement ready {rep['seconds']:.2f} s (shard {rep['sent_bytes'] / 1e6:.1f} MB sent); "
              f"streams resumed {recs[0].resume_s:.2f} s after the yield notice; "
              f"{recs[0].streams} streams, {recs[0].replayed_tokens} tokens replayed; {summary['recoveries']}; "
              f"agent: {yielded[-1] if yielded else '?'}")
        # afterwards the ring serves new requests normally
        req = GenerateRequest("after", messages=CONVS[0], sampling=SamplingParams(max_tokens=8))
        assert [t for ev in engine.stream(engine.submit(req), timeout=30) for t in ev.token_ids] == refs[0][:8]
    finally:
        engine.close()
        for a in procs:
            set_idle(a.idle_file, 3600)  # away again, for the next test


def test_no_spare_and_no_local_fallback_ends_streams_with_the_reason(agents, refs):
    procs, keys, peers = agents
    time.sleep(1.0)  # the agents see their owners away again
    two = peers[:2]
    engine = launch_fleet(keys, two, CFG)
    try:
        session = engine.fleet
        agent = _agent_of(procs, session.stages[1].peer)
        got = _run_streams(engine, "n", lambda: set_idle(agent.idle_file, 0))
        errors = 0
        for (rid, evs), ref in zip(got.items(), refs):
            final = evs[-1]
            kept = [t for ev in evs for t in ev.token_ids]
            if final.finish_reason == "stop":  # reached its end of text before the yield
                assert kept == ref, rid
                continue
            errors += 1
            assert final.finish_reason == "error", (rid, final)
            assert "nothing can host layers 4–8" in final.error, final.error
            assert "not allowed" in final.error and "already hosts a stage" in final.error, final.error
            assert len(kept) >= 4 and kept == ref[:len(kept)], "the streamed text is not a prefix of the answer"
        assert errors >= 2
        print(f"\nno spare: streams ended with: {final.error}")
        from engine.core.interface import EngineError

        with pytest.raises(EngineError, match="nothing can host"):
            engine.submit(GenerateRequest("late", messages=CONVS[0], sampling=SamplingParams(max_tokens=4)))
    finally:
        engine.close()
        for a in procs:
            set_idle(a.idle_file, 3600)


def test_killed_worker_without_spare_recovers_onto_this_pc(agents, refs):
    """A lost stage (its worker killed: a crash, not a yield) and no spare agent:
    with local_fallback the layers run on this PC, CURVE under the controller's key."""
    import dataclasses
    import os
    import signal

    procs, keys, peers = agents
    time.sleep(1.0)  # the agents see their owners away again
    engine = launch_fleet(keys, peers[:2], dataclasses.replace(CFG, local_fallback=True))
    try:
        session = engine.fleet
        old = session.stages[1]
        got = _run_streams(engine, "k", lambda: os.kill(old.pid, signal.SIGKILL))
        for (rid, evs), ref in zip(got.items(), refs):
            assert evs[-1].finish_reason in ("stop", "length"), (rid, evs[-1].error)
            assert [t for ev in evs for t in ev.token_ids] == ref, f"{rid} differs from uninterrupted greedy"
        assert session.stages[1].peer is None and session.stages[1].host == "this PC"
        rec = next(r for r in engine.recovery.records if r.ok)
        assert not rec.graceful and rec.lost == (1,)
        print(f"\nkilled stage 1, no spare: onto this PC; detected via the agent's worker_exit event, "
              f"streams resumed {rec.resume_s:.2f} s after detection (replan {rec.replan_s:.2f} s, "
              f"{rec.streams} streams, {rec.replayed_tokens} tokens replayed)")
        local_pid = session.stages[1].pid
    finally:
        engine.close()
    assert _gone_within(local_pid, time.time()) < 5.0, "the local worker outlived engine.close()"
