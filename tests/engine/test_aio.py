"""engine/aio.py: the one loop kind on every OS, and nothing else creating loops."""

from __future__ import annotations

import ast
import asyncio
import sys
import threading
from pathlib import Path

import pytest

from engine import aio

REPO = Path(__file__).resolve().parents[2]
# Calls that would pick the OS's default loop (Proactor on Windows, where zmq.asyncio is dead)
# or asyncio subprocesses (which a selector loop on Windows cannot run).
FORBIDDEN = {("asyncio", "run"), ("asyncio", "new_event_loop"), ("asyncio", "get_event_loop"),
             ("asyncio", "create_subprocess_exec"), ("asyncio", "create_subprocess_shell"),
             ("asyncio", "set_event_loop_policy")}


def test_run_uses_a_selector_loop_even_where_the_default_is_proactor(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")  # the seam is sys.platform: no branch may pick Proactor

    async def kind() -> type:
        return type(asyncio.get_running_loop())

    assert issubclass(aio.run(kind()), asyncio.SelectorEventLoop)


def test_loop_thread_runs_coroutines_for_sync_callers():
    t = aio.LoopThread("test-loop")
    try:
        async def where() -> str:
            await asyncio.sleep(0)
            return threading.current_thread().name

        assert t.call(where(), timeout=5) == "test-loop"
        assert isinstance(t.loop, asyncio.SelectorEventLoop)

        async def on_its_thread() -> bool:
            return t.on_loop_thread()

        assert t.call(on_its_thread(), timeout=5) and not t.on_loop_thread()  # where waiting would deadlock

        async def boom() -> None:
            raise ValueError("from the loop")

        with pytest.raises(ValueError, match="from the loop"):
            t.call(boom(), timeout=5)
        cancelled = threading.Event()

        async def slow() -> None:
            try:
                await asyncio.sleep(30)
            finally:
                cancelled.set()

        with pytest.raises(TimeoutError):
            t.call(slow(), timeout=0.2)
        assert cancelled.wait(5), "a timed-out coroutine kept running"
    finally:
        t.stop()
    assert not t.running and t.loop.is_closed()

    async def late() -> None:
        pass

    with pytest.raises(RuntimeError, match="stopped"):
        t.submit(late())


def _forbidden_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in FORBIDDEN:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: asyncio.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "asyncio":
            for alias in node.names:
                if ("asyncio", alias.name) in FORBIDDEN:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: from asyncio import {alias.name}")
    return found


def test_no_module_makes_its_own_loop_or_asyncio_subprocess():
    files = [p for d in ("engine", "app", "installers") for p in (REPO / d).rglob("*.py")
             if p != REPO / "engine" / "aio.py"]
    assert len(files) > 50
    bad = [hit for p in files for hit in _forbidden_calls(p)]
    assert not bad, "use engine.aio (one selector loop on every OS) instead:\n" + "\n".join(bad)
