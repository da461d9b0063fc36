"""A shard worker: one pipeline stage in its own process.

    python -m engine.shards.worker --shard DIR --bind tcp://127.0.0.1:PORT \
        [--next tcp://HOST:PORT] [--exact] [--device CPU] [--threads N]

It loads one exported shard (engine.shards.export), binds a ROUTER socket
and serves the ring (engine/protocol/pipeline.py has the picture):

- StageStep (+ a token-id or hidden-state tensor) from the previous stage or,
  for stage 0, the coordinator: run it on that stream's own InferRequest (its
  KV state) and send the result to the next stage (a DEALER connected to
  --next, or to the address a StageConfigure gives). The last stage sends a
  StageResult with the next token id, plus the last position's logits row
  only when the request samples. Speculative steps (want_all) get the argmax
  of every position and, when sampling, every logits row.
- Mask-based rollback (engine/runtime/kv_state.py): each stream keeps a
  visibility bit per physical KV position. A step's `hide` ranges are hidden
  (attention_mask 0), `compact` drops the hidden positions physically, and
  position_ids follow the logical length, which must equal the step's
  `position`.
- StagePing -> StagePong (health, queue depth, compute ms), StageFree
  (cancel/finish: drop state and queued steps), StageConfigure, StageShutdown.

One thread serves everything: before each compute it drains every message
waiting in the socket (zmq queues them in its I/O thread meanwhile), so
control messages are answered between steps and a free drops queued work.
Steps run first-come first-served, which is fair because the coordinator has
at most one step per stream in the ring.

Errors never stop the worker. Input it cannot read gets an ErrorReply: sent
back to the sender when the sender is the coordinator (socket identity
starting with b"coord"), otherwise forwarded down the ring, which ends at the
coordinator. A step that fails (bad shape, unknown stream, KV length
mismatch, inference error) ends only its stream: the worker drops that
stream's state and sends ErrorReply(request_id=stream id) down the ring.
ErrorReplies arriving from an earlier stage are passed on unchanged.

TCP_NODELAY: libzmq sets it on every TCP connection it makes or accepts
(tcp.cpp, tune_tcp_socket), with no option to turn it off; the pipeline tests
check it on a live connection.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from engine.platform.memory import settle_heap
from engine.shards.health import computing, serve_with_heartbeats, tune_data_socket
from engine.protocol import ErrorReply, ProtocolError, decode_frames, encode_frames
from engine.protocol.pipeline import (
    StageConfigure,
    StageFree,
    StagePing,
    StagePong,
    StageResult,
    StageShutdown,
    StageStep,
)

log = logging.getLogger("flotilla.pipeline.worker")

COORD_PREFIX = b"coord"  # socket identities of the coordinator (and of tools acting as one)
IDLE_POLL_MS = 100  # how long the idle loop waits for a message
MAX_DRAIN = 1024  # messages read per drain, so a flood cannot starve compute
TOMBSTONES = 4096  # freed stream ids remembered, so their late steps are dropped quietly
POOL = 16  # idle InferRequests kept for new streams
KV_PRECISIONS = ("f16", "bf16", "u8", "f32")  # what --kv-precision takes (the CPU plugin's KV_CACHE_PRECISION)
SNDHWM = 10_000  # queued outgoing messages before sends fail (the ring holds far fewer)


@dataclass
class WorkerConfig:
    shard: Path  # shard folder (or any file inside it, e.g. shard.xml)
    bind: str = "tcp://127.0.0.1:*"  # where the previous stage and the coordinator connect; * = free port
    next_endpoint: str | None = None  # where outputs go; None = wait for a StageConfigure
    device: str = "CPU"  # OpenVINO device
    exact: bool = False  # f32 inference + f32 KV cache (bit-comparable with torch)
    kv_precision: str | None = None  # KV_CACHE_PRECISION (e.g. "f16": the exact prompt cache); None = default
    threads: int | None = None  # INFERENCE_NUM_THREADS; None = the plugin's choice
    cache_dir: Path | None = None  # compiled-blob cache, used only where compiling is slow (GPU/NPU; ov_compile)
    name: str = ""  # how errors name this stage until a StageConfigure names it
    parent_pid: int | None = None  # exit when this process is gone (no orphans)
    max_chunk: int = 8192  # tokens per step at most
    curve: Path | None = None  # CURVE setup file (engine/transport/curve_data.py); None = plaintext data plane
    next_key: str = ""  # CURVE public key of --next (with curve)


@dataclass
class _Stream:
    stream: Any  # ShardStream: this stream's InferRequest and KV state (a StatefulStream)
    past: int = 0  # tokens physically in its KV state (visible or hidden)
    seq: int = 0  # the next step number expected

    @property
    def mask(self) -> Any:
        """engine.runtime.kv_state.VisibleMask: which of its positions are visible."""
        return self.stream.state.mask


@dataclass
class _Stats:
    steps: int = 0  # steps computed
    compute_ms_total: float = 0.0  # their compute time
    compute_ms_last: float = 0.0  # the last one's
    errors: int = 0  # inputs answered with an ErrorReply


class ShardWorker:
    def __init__(self, cfg: WorkerConfig, ctx: zmq.Context | None = None) -> None:
        self.cfg = cfg
        folder = Path(cfg.shard)
        self.folder = folder.parent if folder.is_file() else folder
        self.ctx = ctx or zmq.Context.instance()
        self.inbox = self.ctx.socket(zmq.ROUTER)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting coordinator keeps its identity
        self.out: zmq.Socket | None = None
        self.out_endpoint: str | None = None
        self.out_key = ""  # CURVE server key of out_endpoint
        self.curve: Any = None  # engine.transport.curve_data.CurveEnd when the data plane is encrypted
        self._zap: Any = None  # its ZAP handler (admits the coordinator and the previous stage)
        self.endpoint = ""
        self.name = cfg.name
        self.runner: Any = None
        self.info: Any = None
        self.streams: dict[str, _Stream] = {}
        self.pool: list[Any] = []
        self.queue: collections.deque[tuple[StageStep, np.ndarray]] = collections.deque()
        self.freed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.stats = _Stats()
        self._stop = False

    # -- setup -----------------------------------------------------------------
    def bind(self) -> str:
        """Bind the inbox; returns the actual endpoint (a * port resolved)."""
        if self.cfg.curve is not None:
            from engine.transport.curve_data import CurveEnd

            self.curve = CurveEnd.load(self.cfg.curve)
            self._zap = self.curve.serve(self.ctx, self.inbox)
        self.inbox.bind(self.cfg.bind)
        self.endpoint = self.inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    def load(self) -> None:
        from engine.shards.export import ShardInfo
        from engine.shards.runtime import ShardRunner

        self.info = ShardInfo.load(self.folder)
        config: dict[str, Any] = {"INFERENCE_NUM_THREADS": int(self.cfg.threads)} if self.cfg.threads else {}
        if self.cfg.kv_precision and not self.cfg.exact:
            config["KV_CACHE_PRECISION"] = self.cfg.kv_precision
        t = time.perf_counter()
        self.runner = ShardRunner(self.info, self.cfg.device, exact=self.cfg.exact,
                                  cache_dir=self.cfg.cache_dir, config=config)
        self.name = self.name or f"layers {self.info.start}-{self.info.end}"
        log.info("%s: loaded %s (layers %d-%d of %d) on %s in %.2f s", self.name, self.folder,
                 self.info.start, self.info.end, self.info.num_layers_total, self.cfg.device,
                 time.perf_counter() - t)
        if self.cfg.next_endpoint:
            self._connect(self.cfg.next_endpoint, self.cfg.next_key)

    def _connect(self, endpoint: str, key: str = "") -> None:
        if endpoint == self.out_endpoint and key == self.out_key:
            return
        if self.curve is not None and not key:
            raise ProtocolError(f"{self.name}: this worker is encrypted; the next hop needs a CURVE key")
        if self.out is not None:
            self.out.close(0)
        self.out = self.ctx.socket(zmq.DEALER)
        if self.curve is not None:
            self.curve.client(self.out, key)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.setsockopt(zmq.SNDHWM, SNDHWM)
        tune_data_socket(self.out)  # ZMTP heartbeats: a vanished next stage is noticed (health.py)
        self.out.setsockopt(zmq.IDENTITY, f"stage-{os.getpid()}".encode())
        self.out.connect(endpoint)
        self.out_endpoint, self.out_key = endpoint, key
        log.info("%s: sending to %s", self.name, endpoint)

    def close(self) -> None:
        for sock in (self.inbox, self.out):
            if sock is not None:
                sock.close(0)
        if self._zap is not None:
            self._zap.stop()

    # -- the loop --------------------------------------------------------------
    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while not self._stop:
            ready = bool(self.queue) and self.out is not None
            if poller.poll(0 if ready else IDLE_POLL_MS):
                self._drain()
            if self.queue and self.out is not None and not self._stop:
                step, x = self.queue.popleft()
                self._compute(step, x)
        log.info("%s: stopped", self.name)

    def _drain(self) -> None:
        for _ in range(MAX_DRAIN):
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames[0].bytes, frames[1:])

    def _handle(self, sender: bytes, frames: list) -> None:
        try:
            msg, tensors = decode_frames(frames)
        except ProtocolError as e:
            self._error(sender, ErrorReply.from_exception(e))
            return
        try:
            if isinstance(msg, StageStep):
                self._accept(msg, tensors)
            elif isinstance(msg, StagePing):
                self._send_to(sender, self._pong(msg.nonce))
            elif isinstance(msg, StageFree):
                self._free(msg.stream_ids)
            elif isinstance(msg, StageConfigure):
                self.name = msg.name
                self._connect(msg.next_endpoint, msg.next_key)
                self._send_to(sender, self._pong(0))  # the coordinator waits for this
            elif isinstance(msg, ErrorReply):
                self._downstream(msg)  # an earlier stage's error, on its way to the coordinator
            elif isinstance(msg, StageShutdown):
                log.info("%s: shutdown requested (%s)", self.name, msg.reason or "no reason")
                self._stop = True
            else:
                raise ProtocolError(f"a pipeline worker does not take {msg.KIND} messages", "unknown_kind")
        except ProtocolError as e:
            self._error(sender, ErrorReply.from_exception(e, getattr(msg, "stream_id", None)))

    def _accept(self, step: StageStep, tensors: list[np.ndarray]) -> None:
        """Check a step's tensor against this shard, then queue it."""
        if step.stream_id in self.freed:
            return  # cancelled while in flight: nothing to say
        info = self.info
        if len(tensors) != 1:
            raise ProtocolError(f"a step carries exactly one tensor, got {len(tensors)}")
        x = tensors[0]
        if info.first:
            ok = x.dtype == np.int64 and x.ndim == 2 and x.shape[0] == 1
            want = "int64 token ids [1, n]"
        else:
            ok = x.dtype == np.float32 and x.ndim == 3 and x.shape[0] == 1 and x.shape[2] == info.hidden_size
            want = f"float32 hidden states [1, n, {info.hidden_size}]"
        if not ok:
            raise ProtocolError(f"{self.name} expects {want}, got {x.dtype}{list(x.shape)}")
        n = x.shape[1]
        if not 1 <= n <= self.cfg.max_chunk:
            raise ProtocolError(f"a step holds 1..{self.cfg.max_chunk} tokens, got {n}")
        if info.first and (int(x.min()) < 0 or int(x.max()) >= info.vocab_size):
            raise ProtocolError(f"token ids must be in 0..{info.vocab_size - 1}")
        if step.past + n > 2**31 - 1:
            raise ProtocolError("the stream is too long")
        self.queue.append((step, x))

    def _compute(self, step: StageStep, x: np.ndarray) -> None:
        sid = step.stream_id
        try:
            st = self._open(step)
            n = x.shape[1]
            t = time.perf_counter()
            self._rollback(st, step)
            feed = {"input_ids" if self.info.first else "hidden_states": x}  # the stream adds mask, positions
            if self.info.last:  # logits only where they are read: every position to verify, else the last
                feed["logits_to_keep"] = np.array([n if step.want_all else 1], np.int64)
            with computing(self):  # pings are answered meanwhile (engine/shards/health.py)
                out = st.stream.step(feed, n)
            ms = (time.perf_counter() - t) * 1000.0
        except ProtocolError as e:
            self._drop(sid)
            self.stats.errors += 1
            self._downstream(ErrorReply.from_exception(e, sid))
            return
        except Exception as e:  # an inference failure ends this stream only
            log.exception("%s: step %d of %s failed", self.name, step.seq, sid)
            self._drop(sid)
            self.stats.errors += 1
            self._downstream(ErrorReply(sid, "internal", f"{self.name}: inference failed "
                                                         f"({type(e).__name__})"))
            return
        st.past += n
        st.seq += 1
        self.stats.steps += 1
        self.stats.compute_ms_total += ms
        self.stats.compute_ms_last = ms
        ms_so_far = (*step.stage_ms, ms)
        if not self.info.last:
            fwd = msgspec.structs.replace(step, stage_ms=ms_so_far)
            self._downstream(fwd, [out["hidden_states_out"]])
            return
        if step.want_all:  # a speculative verify step: every position
            tokens = tuple(int(t) for t in out["next_token"][0])
            rows = [out["logits"][0]] if step.want_logits else []  # [n, V] float32
            self._downstream(StageResult(sid, step.seq, tokens[-1], ms_so_far, tokens), rows)
            return
        token = int(out["next_token"][0, -1]) if step.want_token else None
        rows = [out["logits"][0, -1]] if step.want_logits else []  # [V] float32
        self._downstream(StageResult(sid, step.seq, token, ms_so_far), rows)

    def _rollback(self, st: _Stream, step: StageStep) -> None:
        """Hide the step's ranges, compact when asked; check its logical position."""
        if step.hide:
            st.mask.hide_ranges(step.hide)
        if step.compact and st.mask.hidden:
            st.stream.state.compact()  # every state: [1, kv, visible, d]
            st.past = st.mask.length
        if step.logical != st.mask.visible:
            raise ProtocolError(f"stream {step.stream_id}: step {step.seq} starts at position "
                                f"{step.logical}, but {self.name} holds {st.mask.visible} visible tokens")

    def _open(self, step: StageStep) -> _Stream:
        """The stream's state, opened empty on a reset step; checks the step follows on."""
        sid = step.stream_id
        st = self.streams.get(sid)
        if step.reset:
            if st is None:
                stream = self.pool.pop() if self.pool else self.runner.new_stream()
                st = self.streams[sid] = _Stream(stream)
            st.stream.reset()  # every state = empty [1, kv_heads, 0, head_dim], nothing visible
            st.past, st.seq = 0, step.seq
        if st is None:
            raise ProtocolError(f"stream {sid} is not open on {self.name}", "not_found")
        if step.past != st.past or step.seq != st.seq:
            raise ProtocolError(f"stream {sid}: step {step.seq} at past {step.past}, but {self.name} "
                                f"expects step {st.seq} at past {st.past}")
        return st

    def _drop(self, sid: str) -> None:
        st = self.streams.pop(sid, None)
        if st is not None and len(self.pool) < POOL:
            self.pool.append(st.stream)

    def _free(self, sids: tuple[str, ...]) -> None:
        gone = set(sids)
        for sid in sids:
            self._drop(sid)
            self.freed[sid] = None
        while len(self.freed) > TOMBSTONES:
            self.freed.popitem(last=False)
        if self.queue:
            self.queue = collections.deque(q for q in self.queue if q[0].stream_id not in gone)

    # -- replies ---------------------------------------------------------------
    def _pong(self, nonce: int) -> StagePong:
        s = self.stats
        return StagePong(
            nonce=nonce, name=self.name, pid=os.getpid(), start=self.info.start, end=self.info.end,
            configured=self.out is not None, streams=len(self.streams), queue_depth=len(self.queue),
            steps=s.steps, compute_ms_last=s.compute_ms_last,
            compute_ms_mean=s.compute_ms_total / s.steps if s.steps else 0.0, errors=s.errors)

    def _send_to(self, identity: bytes, msg: Any, tensors: list[np.ndarray] = ()) -> None:
        try:
            self.inbox.send_multipart([identity, *encode_frames(msg, list(tensors))], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the sender went away: nobody to tell
            log.warning("%s: cannot answer %r: %s", self.name, identity[:16], e)

    def _downstream(self, msg: Any, tensors: list[np.ndarray] = ()) -> None:
        if self.out is None:
            log.warning("%s: no next stage yet; dropping %s", self.name, msg.KIND)
            return
        try:
            self.out.send_multipart(encode_frames(msg, list(tensors)), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.error("%s: next stage is not taking messages; dropping %s", self.name, msg.KIND)

    def _error(self, sender: bytes, reply: ErrorReply) -> None:
        """Answer bad input: to the coordinator directly, else down the ring to it."""
        self.stats.errors += 1
        log.warning("%s: refused input from %r: %s", self.name, sender[:16], reply.message)
        if sender.startswith(COORD_PREFIX):
            self._send_to(sender, reply)
        else:
            self._downstream(reply)


# -- process entry -----------------------------------------------------------


def watch_parent(pid: int, interval: float = 0.5, on_gone: Any = None) -> threading.Thread:
    """Exit this process (code 3) as soon as process `pid` -- the one that started us -- is
    gone: by pid + creation time (engine/platform/process.py), not os.getppid(), which never
    changes on Windows when the parent dies. Gone at once when pid is already gone or was
    reused by a process younger than us. on_gone replaces the exit (tests)."""
    from engine.platform.process import parent_ref, watch

    def gone() -> None:
        log.error("parent process %d is gone; exiting", pid)
        if on_gone is not None:
            on_gone()
            return
        os._exit(3)  # StreamHandler flushed the line above; no cleanup may hang us here

    return watch(parent_ref(pid), gone, interval, name="parent-watch")


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    p = argparse.ArgumentParser(prog="python -m engine.shards.worker", description=__doc__.split("\n")[0])
    p.add_argument("--shard", required=True, type=Path, help="exported shard folder (or a file in it)")
    p.add_argument("--bind", help="zmq endpoint to bind, e.g. tcp://127.0.0.1:5555 (port * = any free one)")
    p.add_argument("--port", type=int, help="bind tcp://0.0.0.0:PORT (the fleet agent's form of --bind)")
    p.add_argument("--next", dest="next_endpoint", help="where outputs go (default: wait for a StageConfigure)")
    p.add_argument("--device", default="CPU", help="OpenVINO device (default CPU)")
    p.add_argument("--exact", action="store_true", help="f32 inference and KV cache")
    p.add_argument("--kv-precision", choices=KV_PRECISIONS,
                   help="KV cache element type (default: the plugin's; f16 keeps a read-back of the "
                        "state lossless, which the pipeline's exact prompt cache needs)")
    p.add_argument("--threads", type=int, help="OpenVINO inference threads (default: the plugin's choice)")
    p.add_argument("--cache-dir", type=Path,
                   help="OpenVINO compiled-blob cache folder (GPU/NPU; on CPU the shard compiles from its IR)")
    p.add_argument("--name", default="", help="stage name for logs and errors")
    p.add_argument("--parent-pid", type=int, help="exit when this process is gone (pid + creation time)")
    p.add_argument("--curve", type=Path, help="CURVE setup file (written by the agent): encrypt and "
                                              "authenticate the data plane (default: plaintext)")
    p.add_argument("--next-key", default="", help="CURVE public key of --next (with --curve)")
    a = p.parse_args(argv)
    bind = a.bind or (f"tcp://0.0.0.0:{a.port}" if a.port else "tcp://127.0.0.1:*")
    return WorkerConfig(shard=a.shard, bind=bind, next_endpoint=a.next_endpoint, device=a.device,
                        exact=a.exact, kv_precision=a.kv_precision, threads=a.threads, cache_dir=a.cache_dir,
                        name=a.name, parent_pid=a.parent_pid, curve=a.curve, next_key=a.next_key)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s worker[{os.getpid()}] %(levelname)s %(message)s")
    if cfg.parent_pid:
        watch_parent(cfg.parent_pid)
    worker = ShardWorker(cfg)
    try:
        endpoint = worker.bind()
        # One JSON line on stdout tells a launcher the bound address (port * resolved);
        # stdout then goes to stderr so nothing else can fill an unread pipe.
        print(json.dumps({"event": "bound", "endpoint": endpoint, "pid": os.getpid()}), flush=True)
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        worker.load()
        settle_heap()  # as `flotilla serve` does: no full collection of the loaded libraries mid-pass
        serve_with_heartbeats(worker)  # worker.serve() + pings answered during compute
    except KeyboardInterrupt:
        pass
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
