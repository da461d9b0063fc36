"""CoordinatorWire: PipelineEngine's sockets to the ring and the health of its stages.

A mixin of PipelineEngine (coordinator.py), run on its state: opening the return
and control sockets, configuring the ring, sending, waking the coordinator
thread, and noticing a stage that exited or stopped answering pings.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import numpy as np
import zmq

from engine.core.interface import EngineError
from engine.shards.health import tune_data_socket
from engine.pipeline.stage_link import StageLink
from engine.shards.worker_process import describe_exit, log_tail
from engine.protocol import ErrorReply, ProtocolError, decode_frames, encode_frames
from engine.protocol.pipeline import StageConfigure, StagePing, StagePong

log = logging.getLogger(__name__)

COORD_IDENTITY = b"coord"  # workers answer senders whose identity starts with this directly


class CoordinatorWire:
    """The ring's sockets and liveness (a PipelineEngine mixin)."""

    # -- setup -------------------------------------------------------------------
    def _open_sockets(self) -> None:
        self.ret = self._ctx.socket(zmq.ROUTER)
        self.ret.setsockopt(zmq.LINGER, 0)
        tune_data_socket(self.ret)  # ZMTP heartbeats (engine/shards/health.py)
        curve = self.config.curve
        if curve is not None:  # the return socket admits the stages' keys only
            self._zap = curve.serve(self._ctx, self.ret, [link.server_key for link in self.stages])
        self.ret.bind(self.config.return_bind)
        self.return_endpoint = self.config.return_endpoint or self.ret.getsockopt_string(zmq.LAST_ENDPOINT)
        me = COORD_IDENTITY + b"-" + uuid.uuid4().hex[:12].encode()
        self.ctl: list[zmq.Socket] = []
        for link in self.stages:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, me)
            s.setsockopt(zmq.SNDHWM, 0)  # the ring bounds what we queue: one step per stream
            tune_data_socket(s)
            if curve is not None:
                curve.client(s, link.server_key)
            s.connect(link.endpoint)
            self.ctl.append(s)

    def _configure_ring(self) -> None:
        """Tell every stage where to send; wait until each answers (= loaded and wired)."""
        n = len(self.stages)
        for i, link in enumerate(self.stages):
            nxt = self.stages[i + 1].endpoint if i + 1 < n else self.return_endpoint
            key = (self.stages[i + 1].server_key if i + 1 < n else
                   self.config.curve.public if self.config.curve is not None else "")
            self.send_to_stage(i, StageConfigure(nxt, i, n, f"stage {i}", next_key=key))
        waiting = set(range(n))
        deadline = time.monotonic() + self.config.ready_timeout_s
        poller = zmq.Poller()
        for s in self.ctl:
            poller.register(s, zmq.POLLIN)
        while waiting:
            for i in list(waiting):
                dead = self._exit_reason(self.stages[i])
                if dead:
                    raise EngineError(dead)
            if time.monotonic() > deadline:
                names = ", ".join(self.stages[i].label for i in sorted(waiting))
                raise EngineError(f"{names} did not become ready within {self.config.ready_timeout_s:.0f} s")
            for sock, _ in poller.poll(100):
                i = self.ctl.index(sock)
                try:
                    msg, _t = decode_frames(sock.recv_multipart(copy=False))
                except ProtocolError as e:
                    if e.code == "version":  # never going to understand each other: say so now
                        raise EngineError(f"{self.stages[i].label} speaks another Flotilla protocol: {e}") from None
                    log.warning("pipeline: unreadable message from a stage: %s", e)
                    continue
                if isinstance(msg, StagePong) and msg.configured:
                    self._on_pong(i, msg)
                    waiting.discard(i)
                elif isinstance(msg, ErrorReply):
                    raise EngineError(f"{self.stages[i].label} refused its configuration: {msg.message}")
        self._last_pong = [time.monotonic()] * n

    def _close_sockets(self) -> None:
        with self._wake_lock:
            for s in [getattr(self, "ret", None), *getattr(self, "ctl", []), self._wake_rx, self._wake_tx]:
                if s is not None:
                    s.close(0)
            if getattr(self, "_zap", None) is not None:
                self._zap.stop()  # before term(): its socket lives in this context
            self._ctx.term()

    def wake(self) -> None:
        with self._wake_lock:
            if self._wake_tx.closed:
                return
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake is already pending

    def _drain_wake(self) -> None:
        try:
            while True:
                self._wake_rx.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass

    # -- health ------------------------------------------------------------------
    def _on_pong(self, index: int | None, msg: StagePong) -> None:
        if index is None:
            return
        self.stats.pongs[index] = msg
        if hasattr(self, "_last_pong"):
            self._last_pong[index] = time.monotonic()
        if self.stages[index].pid is None:
            self.stages[index].pid = msg.pid

    def _exit_reason(self, link: StageLink) -> str | None:
        if link.proc is None:
            return None
        code = link.proc.poll()
        if code is None:
            return None
        why = f"{link.label} {describe_exit(code)}"
        tail = log_tail(link.log_path) if code > 0 else ""
        return f"{why}: {tail}" if tail else why

    def _check_liveness(self) -> None:
        if self.recovery.enabled:  # detection + re-plan + replay (engine/pipeline/recovery.py)
            self.recovery.tick()
            return
        if self.broken:
            return
        for link in self.stages:
            reason = self._exit_reason(link)
            if reason:
                self.break_ring(reason)
                return
        now = time.monotonic()
        for i, link in enumerate(self.stages):
            silent = now - self._last_pong[i]
            if silent > self.config.ping_timeout_s:
                self.break_ring(f"{link.label} stopped answering for {silent:.0f} s")
                return

    def _ping_all(self, now: float) -> None:
        if self.broken:
            return
        nonce = next(self._nonce)
        for i in range(len(self.stages)):
            self.send_to_stage(i, StagePing(nonce))

    def break_ring(self, reason: str) -> None:
        log.error("pipeline broken: %s", reason)
        self.broken = reason

    # -- wire --------------------------------------------------------------------
    def send_to_stage(self, i: int, msg: Any, tensors: list[np.ndarray] = ()) -> None:
        try:
            self.ctl[i].send_multipart(encode_frames(msg, list(tensors)), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            log.warning("pipeline: cannot send %s to %s: %s", msg.KIND, self.stages[i].label, e)
