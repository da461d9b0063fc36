"""The one way Flotilla runs asyncio: a selector event loop, on every OS.

Why one loop kind everywhere: ZeroMQ's asyncio sockets need ``loop.add_reader()``, which
Windows' default ``ProactorEventLoop`` does not have (pyzmq 27 refuses it unless tornado is
installed; the agent then logs "up" and every request times out). ``asyncio.SelectorEventLoop``
exists on every OS and behaves the same, so the path this suite tests on Linux is the path a
Windows PC runs. Its one gap on Windows — no asyncio subprocesses — is why Flotilla starts
processes with ``subprocess.Popen`` (engine/platform/process.py), never through asyncio.

    run(main())                 # instead of asyncio.run(main())
    t = LoopThread("fleet")     # a loop in a daemon thread, for synchronous callers
    t.call(coro, timeout=5)     # run a coroutine there and wait for its result
    t.submit(coro)              # ... or get a concurrent.futures.Future
    t.on_loop_thread()          # True on the loop's own thread (do not wait for it there)
    t.stop()

Nothing else in engine/ or app/ creates an event loop (tests/engine/test_aio.py checks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_loop() -> asyncio.AbstractEventLoop:
    """A fresh event loop of the one kind Flotilla uses (see the module docstring)."""
    return asyncio.SelectorEventLoop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on a selector loop: runs main to completion, then closes the loop
    (cancelling what is left and shutting down async generators and the default executor)."""
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(main)


class LoopThread:
    """An event loop running in its own daemon thread, for callers that are not async
    (the app's Qt thread, the CLI). Coroutines are handed over thread-safely."""

    def __init__(self, name: str = "flotilla-loop") -> None:
        self.loop = new_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
                for task in pending:
                    task.cancel()
                if pending:
                    self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            finally:
                self.loop.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def on_loop_thread(self) -> bool:
        """True when called on the loop's own thread (from a coroutine or callback there),
        where waiting for a result of the loop would deadlock."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule coro on the loop; its Future resolves in the caller's thread."""
        if not self.running:
            coro.close()
            raise RuntimeError("the event loop thread has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run coro on the loop and wait for its result (its exception is raised here).
        On timeout the coroutine is cancelled and TimeoutError raised."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no result within {timeout:g} s") from None

    def call_soon(self, fn: Any, *args: Any) -> None:
        """Run a plain callable on the loop's thread."""
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop (pending tasks are cancelled) and join its thread. Idempotent."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)
