"""One shard worker process driven over raw sockets: steps, logits, health, bad input.

The worker serves the whole demo model as a single stage (first and last);
this test plays the coordinator (a DEALER with a b"coord..." identity) and
the next hop (a ROUTER the worker's --next points at).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("openvino")
zmq = pytest.importorskip("zmq")

from engine_helpers import reference_greedy  # noqa: E402

from engine.protocol import ErrorReply, decode_frames, encode, encode_frames  # noqa: E402
from engine.protocol.pipeline import (  # noqa: E402
    StageFree,
    StagePing,
    StagePong,
    StageResult,
    StageStep,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PROMPT = "The quick brown fox jumps over the lazy dog while the"
STEPS = 12


class Rig:
    def __init__(self, shard: str, cache_dir: str | None = None):
        self.ctx = zmq.Context()
        self.next = self.ctx.socket(zmq.ROUTER)  # plays the coordinator's return socket
        self.next.setsockopt(zmq.LINGER, 0)
        self.next.bind("tcp://127.0.0.1:*")
        env = dict(os.environ, PYTHONPATH=REPO)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.shards.worker", "--shard", shard, "--bind", "tcp://127.0.0.1:*",
             "--next", self.next.getsockopt_string(zmq.LAST_ENDPOINT), "--exact", "--name", "stage 0",
             "--parent-pid", str(os.getpid())] + (["--cache-dir", cache_dir] if cache_dir else []),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=REPO, start_new_session=True)
        self.endpoint = json.loads(self.proc.stdout.readline())["endpoint"]
        self.coord = self.dealer(b"coord-test")
        self.pong()  # waits until the shard is loaded

    def dealer(self, identity: bytes | None) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if identity:
            s.setsockopt(zmq.IDENTITY, identity)
        s.connect(self.endpoint)
        return s

    def recv(self, sock: zmq.Socket, timeout: float = 30.0, routed: bool = False):
        if not sock.poll(timeout * 1000):
            raise TimeoutError("no answer")
        frames = sock.recv_multipart()
        return decode_frames(frames[1:] if routed else frames)

    def pong(self) -> StagePong:
        self.coord.send_multipart(encode_frames(StagePing(7), []))
        msg, _ = self.recv(self.coord, 60)
        assert isinstance(msg, StagePong)
        return msg

    def step(self, sid: str, seq: int, past: int, ids: list[int], *, token: bool = True,
             logits: bool = False) -> None:
        msg = StageStep(sid, seq, past, reset=past == 0, want_token=token, want_logits=logits)
        self.coord.send_multipart(encode_frames(msg, [np.array([ids], np.int64)]))

    def result(self, timeout: float = 30.0):
        return self.recv(self.next, timeout, routed=True)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.ctx.destroy(0)


@pytest.fixture(scope="module")
def model(demo_dir):
    from transformers import AutoTokenizer

    from engine.shards.export import ensure_shard

    path = demo_dir("demo")
    prompt = AutoTokenizer.from_pretrained(str(path))(PROMPT)["input_ids"]
    shard = ensure_shard(path, 0, 8, num_layers_total=8)
    return path, prompt, shard, reference_greedy(path, prompt, STEPS)


@pytest.fixture(scope="module")
def blobs(tmp_path_factory):
    return tmp_path_factory.mktemp("worker-blobs")


@pytest.fixture(scope="module")
def rig(model, blobs):
    r = Rig(model[2].path, str(blobs))  # the launchers always pass a blob cache folder
    yield r
    r.close()


class Stream:
    """Drives one greedy stream through the rig step by step."""

    def __init__(self, rig: Rig, sid: str, prompt: list[int], chunked: bool = False):
        self.rig, self.sid, self.prompt, self.chunked = rig, sid, prompt, chunked
        self.seq = self.past = 0
        self.tokens: list[int] = []

    def send(self, logits: bool = False) -> None:
        if self.seq == 0 and self.chunked:  # the prompt in two chunks: the first is only acknowledged
            half = len(self.prompt) // 2
            self.rig.step(self.sid, 0, 0, self.prompt[:half], token=False)
            msg, _ = self.rig.result()
            assert isinstance(msg, StageResult) and msg.token is None and msg.seq == 0
            self.seq, self.past = 1, half
            ids = self.prompt[half:]
        elif self.seq == 0:
            ids = self.prompt
        else:
            ids = [self.tokens[-1]]
        self.rig.step(self.sid, self.seq, self.past, ids, logits=logits)
        self.pending = len(ids)

    def take(self, msg: StageResult, tensors) -> None:
        assert msg.stream_id == self.sid and msg.seq == self.seq
        assert len(msg.stage_ms) == 1 and msg.stage_ms[0] > 0
        self.tokens.append(msg.token)
        self.seq += 1
        self.past += self.pending


def test_ping_reports_health_and_tcp_nodelay(rig):
    pong = rig.pong()
    assert (pong.nonce, pong.name, pong.start, pong.end, pong.configured) == (7, "stage 0", 0, 8, True)
    assert pong.pid == rig.proc.pid
    port = int(rig.endpoint.rsplit(":", 1)[1])
    checked = 0
    for fd in os.listdir("/proc/self/fd"):  # our end of the live zmq connection to the worker
        try:
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.family == socket.AF_INET and s.type == socket.SOCK_STREAM and s.getpeername()[1] == port:
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
                checked += 1
        except OSError:
            pass
        finally:
            s.close()
    assert checked >= 1, "found no TCP connection to the worker"


def test_cpu_worker_compiles_from_the_ir_without_a_blob(rig, blobs):
    # On CPU a blob only adds a second copy of the weights (engine/runtime/ov_compile.py):
    # the worker is loaded (the rig waited for its pong) and wrote nothing to the cache.
    rig.pong()
    assert list(blobs.rglob("*")) == []


def test_greedy_steps_equal_transformers_and_logits_on_request(rig, model):
    _path, prompt, shard, want = model
    a = Stream(rig, "a", prompt, chunked=True)
    for i in range(STEPS):
        a.send(logits=(i == 3))
        msg, tensors = rig.result()
        if i == 3:  # a sampling request gets the last-position logits row too
            assert len(tensors) == 1 and tensors[0].shape == (shard.vocab_size,)
            assert int(np.argmax(tensors[0])) == msg.token
        else:
            assert tensors == []
        a.take(msg, tensors)
    assert a.tokens == want
    rig.coord.send_multipart(encode_frames(StageFree(("a",)), []))


def test_malformed_frames_get_error_replies_while_other_streams_go_on(rig, model):
    _path, prompt, shard, want = model
    streams = [Stream(rig, "b", prompt), Stream(rig, "c", prompt[:7])]
    want_c = reference_greedy(model[0], prompt[:7], STEPS)
    bad_inputs = [
        [b"\x93garbage"],  # not msgpack
        [encode(StagePing(1))],  # a message without the frame header
        encode_frames(StageStep("x", 0, 0, True, True, False), [np.zeros((1, 3), np.float32)]),  # wrong dtype
        encode_frames(StageStep("x", 0, 0, True, True, False), [np.array([[10**6]], np.int64)]),  # bad id
        encode_frames(StageStep("x", 0, 0, True, True, False), []),  # no tensor
        encode_frames(StageFree(("x",)), [])[:1] + [b"extra"],  # a frame the header does not announce
        encode_frames(StageResult("x", 0, 1, ()), []),  # a message a worker does not take
    ]
    for i in range(STEPS):
        for s in streams:
            s.send()
        if i < len(bad_inputs):
            rig.coord.send_multipart(bad_inputs[i])
            reply, _ = rig.recv(rig.coord)
            assert isinstance(reply, ErrorReply) and reply.message, reply
            assert reply.code in ("malformed", "unknown_kind")
        got = [rig.result() for _ in streams]
        for msg, tensors in got:
            next(s for s in streams if s.sid == msg.stream_id).take(msg, tensors)
    assert streams[0].tokens == want
    assert streams[1].tokens == want_c
    assert rig.pong().errors >= len(bad_inputs)
    rig.coord.send_multipart(encode_frames(StageFree(("b", "c")), []))


def test_bad_input_from_a_non_coordinator_goes_down_the_ring(rig):
    stranger = rig.dealer(None)
    stranger.send_multipart([b"not a header"])
    reply, _ = rig.result()
    assert isinstance(reply, ErrorReply) and reply.code == "malformed"
    stranger.close(0)


def test_step_errors_end_only_their_stream(rig, model):
    _path, prompt, _shard, _want = model
    rig.step("ghost", 3, 5, [1, 2])  # never opened
    reply, _ = rig.result()
    assert isinstance(reply, ErrorReply) and reply.request_id == "ghost" and reply.code == "not_found"
    d = Stream(rig, "d", prompt)
    d.send()
    d.take(*rig.result())
    rig.step("d", d.seq, d.past + 3, [d.tokens[-1]])  # KV length mismatch
    reply, _ = rig.result()
    assert isinstance(reply, ErrorReply) and reply.request_id == "d" and "expects step" in reply.message
    assert rig.pong().streams == 0  # the broken stream's state was dropped


def test_free_drops_state_and_late_steps(rig, model):
    _path, prompt, _shard, _want = model
    e = Stream(rig, "e", prompt)
    e.send()
    e.take(*rig.result())
    assert rig.pong().streams == 1
    rig.coord.send_multipart(encode_frames(StageFree(("e",)), []))
    rig.step("e", e.seq, e.past, [e.tokens[-1]])  # in flight when it was cancelled: dropped quietly
    with pytest.raises(TimeoutError):
        rig.result(timeout=0.5)
    pong = rig.pong()
    assert pong.streams == 0 and pong.queue_depth == 0


def test_worker_exits_when_its_parent_dies(model, tmp_path):
    # A parent that starts a worker and dies at once: the worker must not outlive it.
    script = (
        "import subprocess, sys, os;"
        f"p = subprocess.Popen([sys.executable, '-m', 'engine.shards.worker', '--shard', {model[2].path!r},"
        "'--parent-pid', str(os.getpid())], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL);"
        "print(p.pid, flush=True); p.stdout.readline()"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return  # exited, not reaped yet by whoever adopted it
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    pytest.fail("the worker outlived its parent")


def test_watch_parent_follows_a_process_by_pid_and_creation_time_not_getppid():
    # On Windows a worker's os.getppid() never changes when its parent dies, so the watch may not
    # rely on it. Here the watched process is older than the watcher but not its OS parent:
    # the watcher must wait for it, then exit (code 3) once it is gone.
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    watcher_code = ("import sys, time; from engine.shards.worker import watch_parent; "
                    "watch_parent(int(sys.argv[1]), interval=0.05); print('watching', flush=True); time.sleep(120)")
    watcher = subprocess.Popen([sys.executable, "-c", watcher_code, str(watched.pid)], cwd=REPO,
                               env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout.readline().strip() == "watching"
        time.sleep(1.0)
        assert watcher.poll() is None, "the watcher exited while the watched process was alive"
        watched.kill()  # not reaped yet: a zombie is gone too
        assert watcher.wait(10) == 3
        assert f"parent process {watched.pid} is gone" in watcher.stderr.read()
    finally:
        for p in (watched, watcher):
            if p.poll() is None:
                p.kill()
                p.wait()
