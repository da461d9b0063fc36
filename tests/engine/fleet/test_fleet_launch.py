"""The fleet launcher on loopback: two real agents, real shard workers, CURVE everywhere.

Agents run as processes (tests/engine/fleet/fleet_helpers.AgentProc) with
the real pipeline worker. Checked, in order (the last test stops the ring):
- an unpaired controller gets NotPaired and nothing happens;
- a plan that does not fit is refused before any byte is sent;
- the launched pipeline answers exactly like transformers greedy (f32);
- a worker's data socket admits the paired controller only: a stranger's
  key is refused at the handshake, a plaintext client gets nothing;
- when a stage's user comes back, the agent's yield reaches the controller
  as a FleetEvent, the listener hook gets it, and requests fail at once.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("openvino")
pytest.importorskip("torch")

from engine_helpers import chat, reference_greedy  # noqa: E402
from fleet_helpers import AgentProc, paired_agents, set_idle  # noqa: E402

from engine.fleet.client import AgentClient, NotPaired  # noqa: E402
from engine.fleet.launch import launch_fleet  # noqa: E402
from engine.fleet.launch_config import LaunchConfig  # noqa: E402
from engine.fleet.session import FleetSession  # noqa: E402
from engine.transport.security import KeyPair  # noqa: E402
from engine.planner.plan import PlanError  # noqa: E402
from engine.protocol.messages import GenerateRequest, SamplingParams  # noqa: E402

TOKENS = 32
CFG = LaunchConfig(model="demo", stages=2, exact=True, max_concurrent=4, device_preference=("CPU",),
                   controller_host="127.0.0.1", recover=False)  # recovery: test_fleet_recovery.py


async def _status(agent: AgentProc, keys: KeyPair):
    client = await AgentClient(keys, agent.control, agent.public_key).async_connect()
    try:
        return await client.status()
    finally:
        client.close()


@pytest.fixture(scope="module")
def agents(tmp_path_factory, demo_dir):
    demo_dir("demo")
    procs, keys, peers = paired_agents(tmp_path_factory.mktemp("launch"), 2)
    try:
        yield procs, keys, peers
    finally:
        for a in procs:
            a.stop()


@pytest.fixture(scope="module")
def fleet(agents):
    procs, keys, peers = agents
    events = []
    session = FleetSession(keys, peers, CFG, on_stage=STAGE_STEPS.append)  # what launch_fleet() does, + on_stage
    session.add_listener(events.append)
    engine = session.launch()
    yield engine, events, procs, keys
    engine.close()


def test_unpaired_controller_is_refused_before_anything_happens(agents):
    procs, keys, peers = agents
    with pytest.raises(NotPaired, match="pair first"):
        launch_fleet(KeyPair.generate(), peers, CFG)
    for a in procs:
        assert asyncio.run(_status(a, keys)).shards == ()


def test_plan_that_does_not_fit_is_refused_before_anything_is_sent(agents):
    procs, keys, peers = agents
    session = FleetSession(keys, peers, LaunchConfig(model="demo", max_concurrent=10**6,
                                                     device_preference=("CPU",)))
    with pytest.raises(PlanError, match="needs") as err:
        session.launch()
    assert "GB" in str(err.value)
    assert session.stages == [] or all(st.sha256 == "" for st in session.stages)
    for a in procs:
        assert asyncio.run(_status(a, keys)).shards == (), "a shard was sent for a plan that does not fit"


def test_fleet_pipeline_equals_transformers_greedy(fleet, demo_dir):
    from transformers import AutoTokenizer

    from engine.runtime.chat import chat_ids

    engine, _events, _procs, _keys = fleet
    summary = engine.fleet.summary()
    assert [st["layers"] for st in summary["plan"]] == [[0, 4], [4, 8]]
    assert len({st["node_id"] for st in summary["plan"]}) == 2
    assert all(st["sent_bytes"] > 0 for st in summary["plan"])
    convs = [chat(("user", "Tell me about the sea.")),
             chat(("system", "You are terse."), ("user", "Name three birds that live near cold rivers."))]
    path = demo_dir("demo")
    tok = AutoTokenizer.from_pretrained(str(path))
    refs = [reference_greedy(path, chat_ids(tok, c), TOKENS) for c in convs]
    ids = [engine.submit(GenerateRequest(f"q{i}", messages=c, sampling=SamplingParams(max_tokens=TOKENS)))
           for i, c in enumerate(convs)]
    got: dict[str, list[int]] = {}

    def drain(rid: str) -> None:
        got[rid] = [t for ev in engine.stream(rid, timeout=60) for t in ev.token_ids]

    threads = [threading.Thread(target=drain, args=(r,)) for r in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[r] for r in ids] == refs


def test_worker_data_socket_admits_paired_keys_only(fleet):
    import zmq
    import zmq.asyncio

    from engine.fleet.client import _handshake
    from engine.transport.security import curve_client
    from engine.protocol import decode_frames, encode_frames
    from engine.protocol.pipeline import StagePing, StagePong

    engine, _events, _procs, keys = fleet
    st = engine.fleet.stages[0]
    endpoint, server = st.peer.endpoint(st.data_port), st.peer.info.public_key

    async def probe():
        ctx = zmq.asyncio.Context()
        try:
            stranger = ctx.socket(zmq.DEALER)
            curve_client(stranger, KeyPair.generate(), server)
            with pytest.raises(NotPaired):
                await _handshake(stranger, endpoint, 5.0)
            stranger.close(0)
            plain = ctx.socket(zmq.DEALER)
            plain.setsockopt(zmq.IDENTITY, b"coord-plain")
            plain.connect(endpoint)
            try:
                # a DEALER's send waits while it has no connection to queue on: once the server
                # has refused the plaintext handshake it may have none (a suite run hung here)
                await asyncio.wait_for(plain.send_multipart(encode_frames(StagePing(1), [])), 2.0)
                assert not await plain.poll(1000), "a plaintext client got an answer"
            except asyncio.TimeoutError:
                pass  # not even queued: refused, as it should be
            plain.close(0)
            paired = ctx.socket(zmq.DEALER)
            paired.setsockopt(zmq.IDENTITY, b"coord-paired")
            curve_client(paired, keys, server)
            await _handshake(paired, endpoint, 5.0)
            await paired.send_multipart(encode_frames(StagePing(2), []))
            assert await paired.poll(5000)
            msg, _ = decode_frames(await paired.recv_multipart())
            paired.close(0)
            return msg
        finally:
            # destroy, not term: after a failed step a socket is still open, and term() waits
            # for it forever (a suite run hung here for 17 min instead of reporting the failure)
            ctx.destroy(linger=0)

    pong = asyncio.run(probe())
    assert isinstance(pong, StagePong) and pong.nonce == 2 and (pong.start, pong.end) == (0, 4)


def test_yield_reaches_the_controller_and_ends_requests(fleet):
    engine, events, procs, keys = fleet
    session = engine.fleet
    seen = []
    session.add_listener(seen.append)
    st = session.stages[1]
    agent = next(a for a in procs if a.public_key == st.peer.info.public_key)
    set_idle(agent.idle_file, 0)  # the owner is back
    t0 = time.monotonic()
    while not seen and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    delay = time.monotonic() - t0
    assert seen, "no FleetEvent after the agent yielded"
    ev = seen[0]
    # the agent announces the yield first ("yielding": a hand-over grace), then stops the worker ("yield")
    assert ev.stage == 1 and ev.event.event in ("yielding", "yield") and ev.node_id == st.peer.node_id
    assert "stage 1" in ev.message and "yield" in ev.message
    assert events and events[0] == ev  # the listener the fixture added at launch too
    assert delay < 4.0, f"yield took {delay:.2f} s to reach the controller"
    req = GenerateRequest("after", messages=chat(("user", "hi")), sampling=SamplingParams(max_tokens=4))
    from engine.core.interface import EngineError

    try:
        final = list(engine.stream(engine.submit(req), timeout=10))[-1]
        assert final.finish_reason == "error" and "yield" in final.error
    except EngineError as e:
        assert "yield" in str(e)
    time.sleep(2.0)  # the agent's hand-over grace ends within 2 s of the user's return
    status = asyncio.run(_status(agent, keys))
    assert all(s.state != "running" for s in status.shards)


STAGE_STEPS: list = []  # the fleet fixture's launch, step by step (StageProgress)


def test_each_stage_reports_its_launch_steps_as_fields(fleet):
    """The app's per-stage bars read these fields (engine.client.launch_fleet), never the words."""
    for i in range(CFG.stages):
        phases = [p.phase for p in STAGE_STEPS if p.stage == i]
        assert phases[0] in ("export", "pack") and phases[-1] == "start", phases
        assert set(phases[1:-1]) <= {"send", "have"} and phases[1:-1], phases
        sent = [p.fraction for p in STAGE_STEPS if p.stage == i and p.phase in ("send", "have")]
        assert sent == sorted(sent) and sent[-1] == 1.0
