"""A worker answers pings while a long step computes (engine/shards/health.py),
so a 2.5 s ping timeout raises no false alarm during a multi-second prefill."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

zmq = pytest.importorskip("zmq")

from engine.shards.health import serve_with_heartbeats  # noqa: E402
from engine.protocol import decode_frames, encode_frames  # noqa: E402
from engine.protocol.pipeline import StagePing, StagePong, StageResult, StageShutdown, StageStep  # noqa: E402

STEP_S = 3.0  # one step's compute: longer than the coordinator's ping timeout


class _SlowStream:
    """A ShardStream as the worker uses it (reset, step, state.mask), whose step takes STEP_S."""

    def __init__(self) -> None:
        from engine.runtime.kv_state import VisibleMask

        self.state = SimpleNamespace(mask=VisibleMask())

    def reset(self) -> None:
        self.state.mask.reset()

    def step(self, inputs, n):  # releases the GIL like OpenVINO's infer()
        time.sleep(STEP_S)
        self.state.mask.commit(n)
        return {"next_token": np.full((1, n), 7, np.int64), "logits": np.zeros((1, n, 16), np.float32)}


def _worker(tmp_path):
    from engine.shards.worker import ShardWorker, WorkerConfig

    w = ShardWorker(WorkerConfig(shard=tmp_path, name="slow stage"), ctx=zmq.Context())
    w.info = SimpleNamespace(first=True, last=True, hidden_size=16, vocab_size=100, start=0, end=1)
    w.runner = SimpleNamespace(new_stream=_SlowStream)
    return w


def _pong_delays(tmp_path, serve) -> tuple[list[float], StageResult]:
    w = _worker(tmp_path)
    endpoint = w.bind()
    ctx = w.ctx
    sink = ctx.socket(zmq.ROUTER)  # plays the coordinator's return socket
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    w._connect(f"tcp://127.0.0.1:{port}")
    thread = threading.Thread(target=serve, args=(w,), daemon=True)
    thread.start()
    ctl = ctx.socket(zmq.DEALER)
    ctl.setsockopt(zmq.IDENTITY, b"coord-test")
    ctl.connect(endpoint)
    try:
        ctl.send_multipart(encode_frames(StageStep("s1", 0, 0, reset=True, want_token=True, want_logits=False),
                                         [np.array([[1, 2, 3]], np.int64)]))
        time.sleep(0.3)  # the step is computing now
        delays = []
        for nonce in range(1, 9):
            t = time.monotonic()
            ctl.send_multipart(encode_frames(StagePing(nonce), []))
            assert ctl.poll(6000), "no pong at all"
            msg, _ = decode_frames(ctl.recv_multipart())
            assert isinstance(msg, StagePong) and msg.nonce == nonce
            delays.append(time.monotonic() - t)
            time.sleep(max(0.0, 0.25 - delays[-1]))
        assert sink.poll(10000), "the step never finished"
        frames = sink.recv_multipart()
        result, _ = decode_frames(frames[1:])
        ctl.send_multipart(encode_frames(StageShutdown("test over"), []))
        thread.join(10)
        assert not thread.is_alive()
        return delays, result
    finally:
        for s in (ctl, sink):
            s.close(0)
        w.close()
        ctx.term()


def test_pings_are_answered_during_a_long_step(tmp_path):
    delays, result = _pong_delays(tmp_path, serve_with_heartbeats)
    assert result.token == 7 and result.stream_id == "s1"  # the step itself was unaffected
    # every ping inside the 3 s step answered at once (a loaded 2-core machine may take
    # a few hundred ms to schedule the responder; one thread would take > 2 s)
    assert max(delays[:6]) < 1.0, delays


def test_without_the_responder_a_long_step_delays_pongs(tmp_path):
    """The contrast that motivated health.py: one thread = a pong waits for the step."""
    delays, _result = _pong_delays(tmp_path, lambda w: w.serve())
    assert delays[0] > 2.0, delays
