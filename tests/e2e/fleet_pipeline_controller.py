"""The controller side of tests/e2e/test_fleet_pipeline_netns.py, run inside
the controller's network namespace. Prints one JSON object per line:

  {"event": "found", "peers": [...]}              agents found over mDNS
  {"event": "code", "node_id": ..., "code": ...}  the test accepts it on that agent
  {"event": "launched", "summary": {...}}
  {"event": "refused", ...}                       unknown key / plaintext against a worker
  {"event": "answers", "ids": [[...], ...], "tok_s": ...}
  {"event": "fleet_event", "message": ...}        after the test made agent 1's user return
  {"event": "after_yield", "finish_reason": ..., "error": ...}
  {"event": "done"}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


async def probe_worker(endpoint: str, server_key: str) -> dict:
    """A stranger's key and a plaintext client against a worker's data socket."""
    import zmq
    import zmq.asyncio

    from engine.fleet.client import FleetError, NotPaired, _handshake
    from engine.transport.security import KeyPair, curve_client
    from engine.protocol import encode_frames
    from engine.protocol.pipeline import StagePing

    ctx = zmq.asyncio.Context()
    out = {}
    try:
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        curve_client(s, KeyPair.generate(), server_key)
        try:
            await _handshake(s, endpoint, 5.0)
            out["stranger"] = "admitted"
        except NotPaired:
            out["stranger"] = "refused"
        except FleetError as e:
            out["stranger"] = f"failed: {e}"
        s.close(0)
        p = ctx.socket(zmq.DEALER)
        p.linger = 0
        p.setsockopt(zmq.IDENTITY, b"coord-plaintext-probe")
        p.connect(endpoint)
        try:
            # a DEALER's send waits while it has no connection to queue on, which it may lack
            # once the stage has refused the plaintext handshake
            await asyncio.wait_for(p.send_multipart(encode_frames(StagePing(7), [])), 2.0)
            out["plaintext"] = "answered" if await p.poll(1500) else "no answer"
        except asyncio.TimeoutError:
            out["plaintext"] = "no answer"
        p.close(0)
    finally:
        ctx.term()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--interface", required=True)
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--agent-key", action="append", required=True)
    ap.add_argument("--prompt", action="append", required=True)
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()

    from engine.fleet.controller_setup import async_discover, async_pair_all, controller_keys
    from engine.fleet.launch import launch_fleet
    from engine.fleet.launch_config import LaunchConfig
    from engine.protocol.messages import ChatMessage, GenerateRequest, SamplingParams

    keys = controller_keys(a.config)
    t0 = time.monotonic()
    peers = asyncio.run(async_discover([a.interface], keys=set(a.agent_key), timeout=20))
    emit(event="found", peers=[{"node_id": p.node_id, "addresses": list(p.addresses), "source": p.source}
                               for p in peers], seconds=round(time.monotonic() - t0, 2))
    if len(peers) != len(a.agent_key):
        return 2
    states = asyncio.run(async_pair_all(keys, peers, "netns-controller", wait=30.0,
                                        on_code=lambda p, c: emit(event="code", node_id=p.node_id, code=c)))
    if set(states.values()) != {"accepted"}:
        emit(event="error", why=f"pairing: {states}")
        return 3
    fleet_events: list = []
    got_event = threading.Event()

    def on_event(ev) -> None:
        fleet_events.append(ev)
        got_event.set()

    engine = launch_fleet(keys, peers, LaunchConfig(model="demo", stages=2, exact=True, max_concurrent=4,
                                                    device_preference=("CPU",), recover=False),
                          on_event=on_event)
    try:
        session = engine.fleet
        emit(event="launched", summary=session.summary(), return_endpoint=engine.return_endpoint)
        st = session.stages[1]
        emit(event="refused", stage=1, **asyncio.run(probe_worker(st.peer.endpoint(st.data_port),
                                                                  st.peer.info.public_key)))
        reqs = [GenerateRequest(f"r{i}", messages=(ChatMessage("user", p),),
                                sampling=SamplingParams(max_tokens=a.tokens)) for i, p in enumerate(a.prompt)]
        t = time.perf_counter()
        ids = [engine.submit(r) for r in reqs]  # interleaved in the ring
        answers: dict[str, list[int]] = {}

        def drain(rid: str) -> None:
            answers[rid] = [t for ev in engine.stream(rid, timeout=120) for t in ev.token_ids]

        threads = [threading.Thread(target=drain, args=(rid,)) for rid in ids]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t
        n = sum(len(v) for v in answers.values())
        emit(event="answers", ids=[answers[r] for r in ids], tok_s=round(n / wall, 1))
        if not got_event.wait(20):
            emit(event="error", why="no fleet event within 20 s")
            return 4
        emit(event="fleet_event", message=fleet_events[0].message, stage=fleet_events[0].stage,
             kind=fleet_events[0].event.event)
        req = GenerateRequest("after", messages=(ChatMessage("user", "hello"),), sampling=SamplingParams(max_tokens=4))
        try:
            final = [ev for ev in engine.stream(engine.submit(req), timeout=30)][-1]
            emit(event="after_yield", finish_reason=final.finish_reason, error=final.error)
        except Exception as e:  # refused at submit: the ring is marked broken
            emit(event="after_yield", finish_reason="refused", error=str(e))
    finally:
        engine.close()
    emit(event="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
