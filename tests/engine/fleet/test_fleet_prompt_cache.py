"""The exact prompt cache over a fleet: two real agents, real shard workers, CURVE.

LaunchConfig.prompt_cache_exact asks every agent (LoadRequest.kv_precision) to start its
worker with a 16-bit KV cache, and the coordinator reuses only whole prefill chunks: a
follow-up turn prefills only what is new, and its greedy answer is the one an uncached
request gets, at the device's default precision (bf16 compute where the CPU has it).
"""

from __future__ import annotations

import pytest

pytest.importorskip("openvino")
pytest.importorskip("psutil")

from engine_helpers import chat, check_follow_up_answers_as_uncached, collect  # noqa: E402
from fleet_helpers import paired_agents  # noqa: E402

from engine.fleet.launch_config import LaunchConfig  # noqa: E402
from engine.fleet.session import FleetSession  # noqa: E402
from engine.pipeline.prompt_cache import EXACT_CACHE_KV  # noqa: E402
from engine.protocol.messages import GenerateRequest, SamplingParams  # noqa: E402

CHUNK = 32  # prefill tokens per step: the conversation spans several chunks
SYSTEM = ("system", "You answer questions about the water of the world. " * 12)
CFG = LaunchConfig(model="demo", stages=2, max_concurrent=2, prefill_chunk=CHUNK, prompt_cache_exact=True,
                   device_preference=("CPU",), controller_host="127.0.0.1", recover=False)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, demo_dir):
    demo_dir("demo")
    procs, keys, peers = paired_agents(tmp_path_factory.mktemp("fleet-cache"), 2)
    try:
        eng = FleetSession(keys, peers, CFG).launch()
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
    check_follow_up_answers_as_uncached(engine, lambda rid, m: _ask(engine, rid, m),
                                        chat(SYSTEM, ("user", "Tell me about rivers.")), CHUNK)
