"""The exact prompt cache over a fleet: two real agents, real shard workers, CURVE.

LaunchConfig.prompt_cache_exact asks every agent (LoadRequest.kv_precision) to start its
worker with a 16-bit KV cache, and the coordinator reuses only whole prefill chunks: a
follow-up turn prefills only what is new, and its greedy answer is the one an uncached
request gets, at the device's default precision (bf16 compute where the CPU has it).
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("openvino")
pytest.importorskip("psutil")

from engine_helpers import chat, collect  # noqa: E402
from fleet_helpers import AgentProc, pair  # noqa: E402

from engine.fleet.discovery import INFO_OFFSET, Peer, async_query_info  # noqa: E402
from engine.fleet.launch_config import LaunchConfig  # noqa: E402
from engine.fleet.session import FleetSession  # noqa: E402
from engine.pipeline.prompt_cache import EXACT_CACHE_KV  # noqa: E402
from engine.protocol.messages import GenerateRequest, SamplingParams  # noqa: E402
from engine.transport.security import KeyPair  # noqa: E402

CHUNK = 32  # prefill tokens per step: the conversation spans several chunks
SYSTEM = ("system", "You answer questions about the water of the world. " * 12)
CFG = LaunchConfig(model="demo", stages=2, max_concurrent=2, prefill_chunk=CHUNK, prompt_cache_exact=True,
                   device_preference=("CPU",), controller_host="127.0.0.1", recover=False)


async def _peer(agent: AgentProc) -> Peer:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    try:
        info = await async_query_info(ctx, "127.0.0.1", agent.base + INFO_OFFSET)
    finally:
        ctx.term()
    return Peer(info, ("127.0.0.1",), "manual", time.time())


@pytest.fixture(scope="module")
def engine(tmp_path_factory, demo_dir):
    demo_dir("demo")
    tmp = tmp_path_factory.mktemp("fleet-cache")
    procs = [AgentProc(tmp / f"n{i}", real_worker=True).start() for i in range(2)]
    keys = KeyPair.generate()

    async def setup():
        for a in procs:
            await pair(a, keys)
        return [await _peer(a) for a in procs]

    try:
        eng = FleetSession(keys, asyncio.run(setup()), CFG).launch()
        try:
            yield eng
        finally:
            eng.close()
    finally:
        for a in procs:
            a.stop()


def _ask(engine, rid, messages):
    req = GenerateRequest(rid, messages=messages, sampling=SamplingParams(max_tokens=10))
    return collect(engine.stream(engine.submit(req), timeout=120))


def test_the_agents_start_their_workers_with_the_lossless_kv_cache(engine):
    import psutil

    for st in engine.fleet.stages:
        assert f"--kv-precision={EXACT_CACHE_KV}" in psutil.Process(st.pid).cmdline()


def test_a_follow_up_turn_over_the_fleet_reuses_whole_chunks_and_answers_as_uncached(engine):
    first = chat(SYSTEM, ("user", "Tell me about rivers."))
    _ids1, text1, end1 = _ask(engine, "f1", first)
    second = first + chat(("assistant", text1), ("user", "And lakes?"))
    ids2, _, end2 = _ask(engine, "f2", second)
    cached = end2.usage.cached_tokens
    assert cached % CHUNK == 0 and end1.usage.prompt_tokens - CHUNK < cached <= end1.usage.prompt_tokens
    engine.set_prompt_cache(0)
    try:
        ids3, _, end3 = _ask(engine, "f3", second)
    finally:
        engine.set_prompt_cache(engine.config.prompt_cache)
    assert end3.usage.cached_tokens == 0
    assert ids2 == ids3
