"""Engine.async_stream: events emitted on an engine's own thread reach every asyncio
reader, in order, however many read at once -- without a thread per reader (the API
serves each streaming request this way)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from engine.core.interface import Engine, EngineInfo
from engine.protocol.messages import GenerateRequest, SamplingParams, TokenEvent, Usage

TOKENS = 20


class TickingEngine(Engine):
    """One thread emits a token of every started request per tick, as a batching
    engine does, then each request's final event."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[str] = []
        self.go = threading.Event()

    @property
    def info(self) -> EngineInfo:
        return EngineInfo("ticking", "ticking", "CPU", 4096)

    def _start(self, request: GenerateRequest) -> None:
        self.started.append(request.request_id)

    def run(self) -> None:
        self.go.wait(30)
        for n in range(TOKENS):
            for rid in self.started:
                self._emit(TokenEvent(rid, text=f" t{n}", token_ids=(n,)))
        for rid in self.started:
            self._emit(TokenEvent(rid, finish_reason="length", usage=Usage(1, TOKENS)))

    def cancel(self, request_id: str) -> None:
        pass

    def _shutdown(self) -> None:
        pass


class NoThreads(concurrent.futures.ThreadPoolExecutor):
    def submit(self, *a, **k):
        raise AssertionError("async_stream handed a wait to a thread pool")


def test_many_concurrent_readers_each_get_every_event_in_order_without_a_thread_each():
    engine = TickingEngine()
    rids = [engine.submit(GenerateRequest(f"r{i}", prompt="hi", sampling=SamplingParams(max_tokens=TOKENS)))
            for i in range(32)]

    async def read(rid: str) -> list[TokenEvent]:
        return [ev async for ev in engine.async_stream(rid)]

    async def main() -> list[list[TokenEvent]]:
        asyncio.get_running_loop().set_default_executor(NoThreads())
        readers = [asyncio.ensure_future(read(r)) for r in rids]
        await asyncio.sleep(0.05)  # every reader is waiting on an empty queue
        emitter = threading.Thread(target=engine.run)
        emitter.start()
        engine.go.set()
        got = await asyncio.wait_for(asyncio.gather(*readers), 30)
        emitter.join()
        return got

    got = asyncio.run(main())
    for rid, events in zip(rids, got):
        assert [ev.token_ids for ev in events[:-1]] == [(n,) for n in range(TOKENS)], rid
        assert events[-1].finish_reason == "length"
    assert not engine._wakers and not engine._queues  # every reader was forgotten


def test_a_reader_that_leaves_early_is_forgotten_and_later_events_are_dropped():
    engine = TickingEngine()
    rid = engine.submit(GenerateRequest("r", prompt="hi", sampling=SamplingParams(max_tokens=TOKENS)))

    async def first_only() -> TokenEvent:
        stream = engine.async_stream(rid)
        emitter = threading.Thread(target=engine.run)
        emitter.start()
        engine.go.set()
        try:
            return await stream.__anext__()
        finally:
            await stream.aclose()
            emitter.join()

    first = asyncio.run(first_only())
    assert first.token_ids == (0,)
    assert rid not in engine._wakers and rid not in engine._queues
