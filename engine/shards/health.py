"""Heartbeats of the pipeline: a stage answers pings even while it computes.

A shard worker serves everything from one thread (engine/shards/worker.py),
so a ping that arrives during a long step (a 512-token prefill chunk of a big
model on an iGPU can take seconds) used to wait for the step to end. The
coordinator then had to allow 30 s of silence before calling a stage lost.

Here the worker's sockets are guarded by `worker.io_lock`:

- serve_with_heartbeats(worker) holds the lock for the whole serve loop and
  starts a responder thread;
- the worker releases the lock only around the inference call itself
  (`with computing(worker): out = stream.run(feed)`; OpenVINO drops the GIL
  there);
- meanwhile the responder thread takes the lock and drains the inbox exactly
  as the serve loop would (worker._drain): pings get their pong at once, steps
  are queued, frees and configures are applied. Nothing else runs during
  inference, so the two threads never use a socket at the same time (the lock
  is the full memory barrier ZeroMQ asks for when a socket changes threads).

So a live stage answers within RESPOND_INTERVAL_S whatever it computes, and
the coordinator can call a stage lost after ~2.5 s of silence without false
alarms (PipelineConfig.ping_timeout_s).

Data plane: tune_data_socket() turns on ZMTP heartbeats on the sockets
between stages, so a TCP connection to a peer that vanished (cable pulled,
Wi-Fi gone: no RST ever comes) is dropped and re-dialled within seconds
instead of hanging until the kernel gives up (~15 min). The coordinator's
step watchdog (engine/pipeline/recovery.py) covers what is lost with it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator

log = logging.getLogger("flotilla.pipeline.health")

RESPOND_INTERVAL_S = 0.05  # how often the responder looks at the inbox while a step computes
ZMTP_HEARTBEAT_IVL_MS = 500  # ZMTP PING every this often on a quiet data-plane connection
ZMTP_HEARTBEAT_TIMEOUT_MS = 2500  # no traffic for this long = the connection is dead: drop, re-dial


def tune_data_socket(sock: Any) -> None:
    """ZMTP heartbeats on a data-plane socket (both ends may set them; harmless if one does)."""
    import zmq

    sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, ZMTP_HEARTBEAT_TIMEOUT_MS)


@contextlib.contextmanager
def computing(worker: Any) -> Iterator[None]:
    """Release the worker's socket lock for the duration of an inference call.

    A no-op unless the worker runs under serve_with_heartbeats (tests that call
    serve() or _compute() directly are unaffected)."""
    lock = getattr(worker, "io_lock", None)
    if lock is None or not getattr(worker, "io_held", False):
        yield
        return
    worker.io_held = False
    lock.release()
    try:
        yield
    finally:
        lock.acquire()
        worker.io_held = True


def serve_with_heartbeats(worker: Any, interval_s: float = RESPOND_INTERVAL_S) -> None:
    """worker.serve(), plus a thread that answers pings while a step computes."""
    lock = getattr(worker, "io_lock", None)
    if lock is None:
        lock = worker.io_lock = threading.Lock()
    stop = threading.Event()

    def respond() -> None:
        while not stop.wait(interval_s):
            if not lock.acquire(blocking=False):
                continue  # the serve loop has the sockets: it answers by itself
            try:
                if stop.is_set() or getattr(worker, "_stop", False):
                    return
                worker._drain()  # pings -> pongs, steps -> queue, free/configure applied
            except Exception:  # never let the responder die silently
                log.exception("heartbeat responder error")
            finally:
                lock.release()

    with lock:
        worker.io_held = True
        thread = threading.Thread(target=respond, name="stage-heartbeat", daemon=True)
        thread.start()
        try:
            worker.serve()
        finally:
            worker.io_held = False
            stop.set()
    thread.join(timeout=1.0)
