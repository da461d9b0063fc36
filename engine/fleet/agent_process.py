"""The agent as a process: its log file, run_agent, and the ways it is asked to stop
(SIGINT/SIGTERM/SIGBREAK, the end of stdin: the tray's and the demo's lifeline)."""

from __future__ import annotations

import asyncio
import logging
import logging.handlers
import threading
from collections.abc import Callable
from pathlib import Path

from engine.fleet.agent import Agent
from engine.fleet.agent_config import AgentConfig
from engine.fleet.paths import ensure_private_dir

log = logging.getLogger("flotilla.agent")


def setup_logging(data: Path, verbose: bool = False) -> Path:
    """Rotating log in <data>/logs/agent.log (1 MB x 3), plus stderr."""
    logs = ensure_private_dir(data / "logs")
    path = logs / "agent.log"
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=1_000_000, backupCount=3)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    stderr = logging.StreamHandler()
    stderr.setFormatter(logging.Formatter("flotilla agent: %(message)s"))
    stderr.setLevel(logging.INFO if verbose else logging.WARNING)
    root.addHandler(stderr)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("zeroconf").setLevel(logging.WARNING)
    return path


def run_agent(cfg: AgentConfig) -> int:
    """Run until SIGINT/SIGTERM (CTRL_BREAK on Windows), a StopRequest(shutdown=True), or,
    with cfg.stdin_lifeline, the end of stdin."""
    from engine import aio

    async def main() -> None:
        agent = Agent(cfg)
        loop = asyncio.get_running_loop()
        stop = lambda: _stop_soon(loop, agent.stopped)  # noqa: E731
        restore = install_stop_signals(stop)
        try:
            if cfg.stdin_lifeline:
                watch_stdin(stop)
            await agent.async_run()
        finally:
            restore()

    aio.run(main())
    return 0


def _stop_soon(loop: asyncio.AbstractEventLoop, stopped: asyncio.Event) -> None:
    """stopped.set() on the loop, from any thread or a signal handler; a no-op once it closed."""
    try:
        loop.call_soon_threadsafe(stopped.set)
    except RuntimeError:
        pass


def install_stop_signals(stop: Callable[[], None]) -> Callable[[], None]:
    """stop() on SIGINT, SIGTERM and (Windows) SIGBREAK: plain signal.signal handlers, which
    every OS runs (asyncio's add_signal_handler does not exist on Windows). Returns a
    function that puts the previous handlers back."""
    import signal

    previous = {}
    for name in ("SIGINT", "SIGTERM", "SIGBREAK"):
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        try:
            previous[sig] = signal.signal(sig, lambda *_: stop())
        except (ValueError, OSError):  # not the main thread: the caller stops us
            pass

    def restore() -> None:
        for sig, handler in previous.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError, TypeError):
                pass

    return restore


def watch_stdin(stop: Callable[[], None], fd: int | None = None) -> threading.Thread:
    """stop() once stdin ends (a daemon thread reads it): the process that started us closed
    its end of the pipe -- how the tray and `flotilla demo` ask for a clean stop on every OS
    (engine/client/agent.py AgentHandle.stop) -- or it died, which closes it too.

    It reads the descriptor (os.read), never sys.stdin: a thread blocked in a buffered read
    holds that object's lock, and a child forked meanwhile (OpenVINO's telemetry forks one)
    inherits the lock held and hangs for ever when multiprocessing closes its sys.stdin."""
    import os
    import sys

    src = fd if fd is not None else sys.stdin.fileno()

    def run() -> None:
        try:
            while os.read(src, 4096):
                pass
        except OSError:
            pass
        log.info("stdin closed: stopping")
        stop()

    t = threading.Thread(target=run, name="agent-stdin", daemon=True)
    t.start()
    return t
