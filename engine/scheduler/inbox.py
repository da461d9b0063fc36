"""The engines whose one scheduler thread admits requests from an inbox (local, batched,
moe, sparse, pipeline): the inbox, cancellation and the thread's start and stop, one copy.

submit() puts (request, submit time) in the inbox and returns; the scheduler thread
(the subclass's _run) moves them to its waiting queue with _take_inbox, admits them as
slots free up, and each turn calls _take_cancelled to end what was cancelled.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Iterable

from engine.protocol.messages import GenerateRequest, TokenEvent, Usage
from engine.runtime.errors import one_line
from engine.runtime.generation import Generation, finished
from engine.core.interface import Engine

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # how long the idle scheduler sleeps between checks


def drain_inbox(inbox: queue.SimpleQueue, waiting: collections.deque, block: bool) -> None:
    """Move submitted requests into `waiting`; with block, wait up to IDLE_WAIT_S for one."""
    try:
        if block:
            waiting.append(inbox.get(timeout=IDLE_WAIT_S))
        while True:
            waiting.append(inbox.get_nowait())
    except queue.Empty:
        pass


def step_failed(gen: Generation, err: Exception) -> TokenEvent:
    """The final event of a running request whose engine step raised (a bug in the step, not
    this request's failure): retrying would likely fail again, so it ends with the error."""
    return finished(gen, "error", error=f"the engine failed: {one_line(err)}")


def refuse_waiting(emit, waiting: collections.deque) -> None:
    """End every request that was never admitted: the engine is closing."""
    for req, _t in waiting:
        emit(TokenEvent(req.request_id, finish_reason="error", error="the engine was closed", error_code="closed",
                        usage=Usage(0, 0)))


class InboxEngine(Engine):
    """An Engine with an inbox and one scheduler thread (the subclass's _run)."""

    def _start_scheduler(self, name: str) -> None:
        """Call at the end of __init__, once everything _run uses exists."""
        self._inbox: queue.SimpleQueue[tuple[GenerateRequest, float]] = queue.SimpleQueue()
        self._cancelled: set[str] = set()  # guarded by self._lock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @abstractmethod
    def _run(self) -> None:
        """The scheduler loop: until self._stop is set."""

    def _start(self, request: GenerateRequest) -> None:
        self._inbox.put((request, time.perf_counter()))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._queues:  # unknown or finished ids are ignored
                self._cancelled.add(request_id)

    def _stop_scheduler(self) -> None:
        """Stop the thread and wait for it (it ends its running requests on the way out)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def _take_inbox(self, waiting: collections.deque, block: bool) -> None:
        drain_inbox(self._inbox, waiting, block)

    def _take_cancelled(self, waiting: collections.deque, running: Iterable[str]) -> set[str]:
        """End the cancelled requests still waiting; return the cancelled ids among `running`
        (the caller ends those). Ids not seen yet (still in the inbox) stay for the next turn."""
        with self._lock:
            if not self._cancelled:
                return set()
            ids = set(self._cancelled)
        running = set(running)
        found = {w[0].request_id for w in waiting} | running
        with self._lock:
            self._cancelled = {i for i in self._cancelled - found if i in self._queues}
        for item in [w for w in waiting if w[0].request_id in ids]:
            waiting.remove(item)
            self._emit(TokenEvent(item[0].request_id, finish_reason="cancelled", usage=Usage(0, 0)))
        return ids & running


class TurnEngine(InboxEngine):
    """An InboxEngine whose loop keeps a list of running Generations: each turn it admits
    waiting requests up to max_concurrent, then lets the subclass advance them (_turn)."""

    max_concurrent: int

    @abstractmethod
    def _admit(self, request: GenerateRequest, t_submit: float) -> Generation | None:
        """Open a request (None: it ended at once, with an error event)."""

    @abstractmethod
    def _turn(self, active: list[Generation]) -> list[Generation]:
        """Advance the running requests by one step each; return those that ended."""

    @abstractmethod
    def _end(self, gen: Generation, event: TokenEvent) -> None:
        """Free a request's state and emit its final event."""

    def _run(self) -> None:
        waiting: collections.deque[tuple[GenerateRequest, float]] = collections.deque()
        active: list[Generation] = []
        while not self._stop.is_set():
            try:
                self._take_inbox(waiting, block=not active and not waiting)
                self._drop_cancelled(waiting, active)
                while waiting and len(active) < self.max_concurrent:
                    gen = self._admit(*waiting.popleft())
                    if gen is not None:
                        active.append(gen)
                for gen in self._turn(active):
                    active.remove(gen)
            except Exception as e:  # a bug in a step: its requests end with an error, new ones are served
                log.exception("%s scheduler error", type(self).__name__)
                self._fail_running(active, e)
        self._take_inbox(waiting, block=False)
        for gen in active:
            self._end(gen, finished(gen, "error", error="the engine was closed", error_code="closed"))
        refuse_waiting(self._emit, waiting)

    def _fail_running(self, active: list[Generation], err: Exception) -> None:
        """A step raised: every running request ends (step_failed; no client waits for an
        answer that cannot come), and `active` empties."""
        for gen in active:
            try:
                self._end(gen, step_failed(gen, err))
            except Exception:  # its state was half-freed: the error event went out (_end's finally)
                log.exception("ending %s after a scheduler error", gen.request_id)
        active.clear()

    def _drop_cancelled(self, waiting: collections.deque, active: list[Generation]) -> None:
        ids = self._take_cancelled(waiting, (g.request_id for g in active))
        for gen in [g for g in active if g.request_id in ids]:
            active.remove(gen)
            self._end(gen, finished(gen, "cancelled"))
