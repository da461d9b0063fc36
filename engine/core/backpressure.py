"""Backpressure: every queue between a user and a model is bounded.

Where requests can pile up, and what bounds each place:

- Engine.submit() (engine/core/interface.py): at most `engine.max_pending`
  requests running + queued (default DEFAULT_MAX_PENDING); one more raises
  EngineOverloaded(retry_after_s). The HTTP API answers it with 429 and a
  Retry-After header (engine/serve/engine_calls.py); the chat UI shows engine.load()
  (running / queued) and can say "3 requests ahead of you".
- Inside an engine: at most max_concurrent requests hold KV state; the rest
  wait in the engine's admission queue (bounded by max_pending above).
- Pipeline ring: at most one step per stream in flight (coordinator.py), so
  a stage's inbox holds at most max_concurrent steps; a worker reads at most
  MAX_DRAIN messages per turn and its output socket fails past SNDHWM.

retry_after_s() turns a queue depth into an honest wait: the requests ahead
of a new one, divided by how many run at once, times how long one takes.
"""

from __future__ import annotations

import math

MIN_RETRY_S = 1.0  # never tell a client to come back sooner than this
MAX_RETRY_S = 60.0  # nor later than this (the queue moves; let the client re-ask)
UNKNOWN_REQUEST_S = 2.0  # a request's duration before any finished


def retry_after_s(pending: int, running_at_once: int, mean_request_s: float) -> float:
    """Seconds until a slot is likely free for a request that found `pending` ahead of it."""
    per = mean_request_s if mean_request_s > 0 else UNKNOWN_REQUEST_S
    rounds = (max(0, pending) + 1) / max(1, running_at_once)
    return float(min(MAX_RETRY_S, max(MIN_RETRY_S, math.ceil(rounds * per))))


def retry_after_header(seconds: float) -> str:
    """The Retry-After value (whole seconds, at least 1)."""
    return str(max(1, int(math.ceil(seconds))))
