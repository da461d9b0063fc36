"""The one interface every Flotilla engine implements.

submit() is non-blocking and returns at once; events come back through
stream() (a blocking iterator, for threads) or async_stream() (for asyncio),
in order, ending with exactly one final event (finish_reason set). cancel()
ends a request early with finish_reason "cancelled". close() stops the engine;
requests still running end with finish_reason "error".

The chat window, the CLI, the HTTP API and the benchmarks only use this, so
they do not care whether a local model, a pipeline or an offloading engine
answers.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from engine.core.backpressure import retry_after_s
from engine.protocol.messages import GenerateRequest, TokenEvent

DEFAULT_MAX_PENDING = 256  # running + queued requests per engine before submit() says "overloaded"


class EngineError(RuntimeError):
    """An engine refused a request (closed, duplicate id, overloaded...). `code` is one of
    the protocol's EVENT_ERROR_CODES ("peer_lost" when a pipeline's ring is broken), so a
    caller branches on it and never on the message's words."""

    def __init__(self, message: str, code: str = "engine") -> None:
        super().__init__(message)
        self.code = code


class EngineOverloaded(EngineError):
    """The engine's queue is full: try again after retry_after_s (the API answers 429)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class EngineLoad:
    """How busy an engine is (engine.load()): for the UI's queue display and for 429s."""

    running: int  # requests being computed now
    queued: int  # accepted requests waiting for a slot
    max_running: int  # requests computed at once (max_concurrent)
    max_pending: int  # running + queued at most; submit() beyond raises EngineOverloaded
    state: str = "ok"  # "ok", "recovering" (a lost peer is being replaced) or "broken"
    detail: str = ""  # one line about the state (which stage, why)


@dataclass(frozen=True)
class EngineInfo:
    model_id: str  # what /v1/models lists and the UI shows
    engine: str  # "local", "pipeline", "moe", "sparse"
    device: str  # e.g. "CPU"
    context_length: int  # tokens (prompt + answer) one request may hold
    tool_format: str = "hermes"  # how the model writes tool calls (engine/runtime/tool_format.py FORMATS)
    unsupported: frozenset[str] = frozenset()  # API fields this engine refuses (a 400 naming the field)


class Engine(ABC):
    """Base class: per-request event queues; subclasses produce events with
    self._emit(event) from whatever thread computes them."""

    def __init__(self) -> None:
        self._queues: dict[str, queue.SimpleQueue[TokenEvent]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._ended: set[str] = set()  # ids whose final event was emitted but not read yet
        # Requests read by async_stream: request id -> (its loop, the event _emit sets there).
        self._wakers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self.max_pending = DEFAULT_MAX_PENDING  # bound on running + queued requests (backpressure)
        self.mean_request_s = 0.0  # moving average of request wall time, for Retry-After

    # -- the interface -------------------------------------------------------
    @property
    @abstractmethod
    def info(self) -> EngineInfo: ...

    def submit(self, request: GenerateRequest) -> str:
        with self._lock:
            if self._closed:
                raise EngineError("the engine is closed")
            if request.request_id in self._queues:
                raise EngineError(f"request id {request.request_id!r} is already in use")
            pending = len(self._queues) - len(self._ended)
            if pending >= self.max_pending:
                wait = retry_after_s(pending, self.capacity(), self.mean_request_s)
                raise EngineOverloaded(f"{pending} requests are already running or queued "
                                       f"(at most {self.max_pending}); retry in {wait:.0f} s", wait)
            self._queues[request.request_id] = queue.SimpleQueue()
        try:
            self._start(request)
        except Exception:
            with self._lock:
                self._queues.pop(request.request_id, None)
            raise
        return request.request_id

    def stream(self, request_id: str, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Yield the events of a request until its final one (then forget it)."""
        q = self._queue(request_id)
        try:
            while True:
                try:
                    event = q.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(f"no event for {request_id} within {timeout} s") from None
                yield event
                if event.final:
                    return
        finally:
            self._forget(request_id)

    async def async_stream(self, request_id: str) -> AsyncIterator[TokenEvent]:
        """The same as stream(), awaiting each event on the running loop.

        _emit wakes the loop itself (call_soon_threadsafe): no thread waits per stream,
        so a burst of concurrent streams is not held up behind the loop's small default
        thread pool, and each token costs one hand-over between threads, not two."""
        q = self._queue(request_id)
        wake = asyncio.Event()
        with self._lock:
            self._wakers[request_id] = (asyncio.get_running_loop(), wake)
        try:
            while True:
                try:
                    event = q.get_nowait()
                except queue.Empty:
                    # _emit puts, then sets `wake` on this loop: an event put after the
                    # get above sets it after this wait began, so none is missed.
                    await wake.wait()
                    wake.clear()
                    continue
                yield event
                if event.final:
                    return
        finally:
            self._forget(request_id)

    def generate(self, request: GenerateRequest) -> list[TokenEvent]:
        """Submit and collect every event (convenience for tests and scripts)."""
        return list(self.stream(self.submit(request)))

    @abstractmethod
    def cancel(self, request_id: str) -> None: ...

    def capacity(self) -> int:
        """Requests computed at once (the engine's max_concurrent)."""
        return max(1, int(getattr(self, "max_concurrent", 1) or 1))

    def load(self) -> EngineLoad:
        """Running and queued requests now (cheap; any thread)."""
        with self._lock:
            pending = len(self._queues) - len(self._ended)
        cap = self.capacity()
        state, detail = self._health()
        return EngineLoad(min(pending, cap), max(0, pending - cap), cap, self.max_pending, state, detail)

    def _health(self) -> tuple[str, str]:
        """(state, detail) for load(); engines that can lose peers override it."""
        return ("broken" if self._closed else "ok"), ""

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- for subclasses --------------------------------------------------------
    @abstractmethod
    def _start(self, request: GenerateRequest) -> None:
        """Begin work on a request; must not block."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Stop computing; end every running request with an error event."""

    def _emit(self, event: TokenEvent) -> None:
        with self._lock:
            q = self._queues.get(event.request_id)
            if q is not None and event.final:
                self._ended.add(event.request_id)
                if event.timings is not None:  # for Retry-After estimates
                    self.mean_request_s = 0.8 * self.mean_request_s + 0.2 * event.timings.total_s
            waker = self._wakers.get(event.request_id)
        if q is not None:
            q.put(event)
        if waker is not None:
            loop, wake = waker
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the reader's loop is closed: nobody is reading
                pass

    # -- internals -------------------------------------------------------------
    def _queue(self, request_id: str) -> queue.SimpleQueue[TokenEvent]:
        with self._lock:
            try:
                return self._queues[request_id]
            except KeyError:
                raise EngineError(f"unknown request id {request_id!r}") from None

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)
            self._ended.discard(request_id)
            self._wakers.pop(request_id, None)
