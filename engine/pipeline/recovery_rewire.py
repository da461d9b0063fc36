"""RecoveryRewire: swapping the coordinator onto a recovered ring (recovery step 4, re-wire).

A mixin of RingRecovery (recovery.py): new control sockets, StageConfigure to
every stage (survivors just reconnect their output), and which stages did not answer.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Sequence

import zmq

from engine.protocol.pipeline import StageConfigure, StagePong, StageShutdown


class RecoveryRewire:
    """Re-wiring the ring (a RingRecovery mixin)."""

    def _rewire(self, links: Sequence[Any]) -> dict[int, str]:
        """Swap the coordinator onto `links`; returns stages that did not answer."""
        e = self.engine
        old_ctl, old_stages = list(e.ctl), list(e.stages)
        # An orderly goodbye to stages that leave the ring (a migration; a dead one ignores it).
        for i, link in enumerate(old_stages):
            if link not in links:
                try:
                    old_ctl[i].send_multipart(_frames(StageShutdown("replaced in the ring")), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        poller = getattr(e, "_poller", None)
        for s in old_ctl:
            if poller is not None:
                try:
                    poller.unregister(s)
                except KeyError:
                    pass
            s.close(linger=100)
        me = b"coord-" + uuid.uuid4().hex[:12].encode()
        curve = getattr(e.config, "curve", None)  # CURVE on the data plane (engine/transport/curve_data.py)
        zap = getattr(e, "_zap", None)
        ctl = []
        for link in links:
            s = e._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, me)
            s.setsockopt(zmq.SNDHWM, 0)
            _tune(s)
            key = getattr(link, "server_key", "")
            if curve is not None:
                curve.client(s, key)
                if zap is not None and key:
                    zap.admit(key)  # the return socket must take the new last stage's results
            s.connect(link.endpoint)
            ctl.append(s)
            if poller is not None:
                poller.register(s, zmq.POLLIN)
        e.stages, e.ctl = list(links), ctl
        for i, link in enumerate(e.stages):
            link.index = i
        n = len(links)
        e.stats.stage_ms = [0.0] * n
        e.stats.pongs = {}
        e._last_pong = [time.monotonic()] * n
        for i, link in enumerate(e.stages):
            nxt = e.stages[i + 1].endpoint if i + 1 < n else e.return_endpoint
            key = (getattr(e.stages[i + 1], "server_key", "") if i + 1 < n else
                   curve.public if curve is not None else "")
            e.send_to_stage(i, StageConfigure(nxt, i, n, f"stage {i}", **({"next_key": key} if key else {})))
        waiting = set(range(n))
        deadline = time.monotonic() + self.config.rewire_timeout_s
        dead: dict[int, str] = {}
        while waiting and time.monotonic() < deadline:
            for i in list(waiting):
                why = e._exit_reason(e.stages[i])
                if why:
                    dead[i] = why
                    waiting.discard(i)
            for i in list(waiting):
                if e.ctl[i].poll(0, zmq.POLLIN):
                    while True:
                        try:
                            frames = e.ctl[i].recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        msg = _decode(frames)
                        if isinstance(msg, StagePong) and msg.configured:
                            e._on_pong(i, msg)
                            waiting.discard(i)
            if waiting:
                time.sleep(0.005)
        for i in waiting:
            dead[i] = f"{e.stages[i].label} did not answer its configuration within " \
                      f"{self.config.rewire_timeout_s:.0f} s"
        return dead


def _frames(msg: Any) -> list:
    from engine.protocol import encode_frames

    return encode_frames(msg, [])


def _decode(frames: list) -> Any:
    from engine.protocol import ProtocolError, decode_frames

    try:
        return decode_frames(frames)[0]
    except ProtocolError:
        return None


def _tune(sock: Any) -> None:
    from engine.shards.health import tune_data_socket

    tune_data_socket(sock)
