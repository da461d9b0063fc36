"""How long the local user has been away from this machine, erring towards "not away".

An IdleSource answers idle_seconds(): seconds since the last keyboard/mouse input, or
None when it cannot tell; it may raise when its reading failed. Platform sources
(engine/platform/idle_*.py), tried in order:

  Linux    logind IdleHint/IdleSinceHint of the graphical session (loginctl),
           then X11: `xprintidle` if installed, else XScreenSaverQueryInfo (libXss)
  Windows  GetLastInputInfo (ctypes)
  macOS    HIDIdleTime from `ioreg -c IOHIDSystem`

A platform source also says whether it applies here at all (applies(): a session, a
display). The difference matters: a machine where no source applies (a headless box)
has no local user to yield to and is reported idle (since boot, or since the last
input a source saw); a source that applies but fails is a user we cannot see, so the
answer is None ("unknown", which the sharing policy never lends on) until a retry,
with backoff, reads it again. Tests inject FileIdleSource or FunctionIdleSource.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from engine.platform import MACOS, WINDOWS, system

log = logging.getLogger(__name__)


class IdleSource(Protocol):
    def idle_seconds(self) -> float | None:
        """Seconds since the last user input; None if unknown (it may also raise)."""


class FunctionIdleSource:
    """Any callable as a source (tests, the tray app feeding its own figure)."""

    def __init__(self, fn: Callable[[], float | None], applies: Callable[[], bool] | None = None) -> None:
        self.fn, self._applies = fn, applies

    def applies(self) -> bool:
        return True if self._applies is None else self._applies()

    def idle_seconds(self) -> float | None:
        return self.fn()


class FileIdleSource:
    """The file holds the unix time of the last user input (a float). A test,
    or a script, writes time.time() there to say "the user is back"."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def idle_seconds(self) -> float | None:
        try:
            last = float(self.path.read_text().strip())
        except (OSError, ValueError):
            return None
        return max(0.0, time.time() - last)


class NoUserSource:
    """No local user at all: idle since `since` (unix time; None = since boot)."""

    def __init__(self, since: Callable[[], float | None] | None = None) -> None:
        self.since = since

    def idle_seconds(self) -> float | None:
        t = self.since() if self.since is not None else None
        return max(0.0, time.time() - (psutil.boot_time() if t is None else t))


@dataclass
class _Slot:
    source: IdleSource
    applies: bool = False  # the last answer of source.applies()
    checked_at: float | None = None  # monotonic time of that answer; None = never asked
    failures: int = 0  # failed readings in a row
    retry_at: float = 0.0  # monotonic time before which a failed source is not read again


class FirstOf:
    """The first applicable source with an answer. A source that applies but fails
    (raises, or says None) is read again only after a backoff (1 s, 2 s, ... 60 s: no
    fork of loginctl every half second while it is broken), and meanwhile the answer is
    None, unknown: never idle. `when_none_apply` answers only when no source applies
    at all (a headless box); it is told the last input a source saw, so a user who
    logs out is not reported idle since boot."""

    RECHECK_S = 60.0  # how often applies() is asked again (a user may log in; a display may go)
    BACKOFF_S = (1.0, 60.0)  # first and longest wait before a failed source is read again

    def __init__(self, sources: Sequence[IdleSource], *, when_none_apply: IdleSource | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = [_Slot(s) for s in sources]
        self.clock = clock
        self.last_input: float | None = None  # unix time of the last input an answer implied
        self.when_none_apply = when_none_apply

    def _applies(self, slot: _Slot, now: float) -> bool:
        if slot.checked_at is None or now - slot.checked_at >= self.RECHECK_S:
            fn = getattr(slot.source, "applies", None)
            try:
                slot.applies = True if fn is None else bool(fn())
            except Exception:  # cannot tell whether a user is there: as if there is one
                log.debug("idle source %s: applies() failed", type(slot.source).__name__, exc_info=True)
                slot.applies = True
            slot.checked_at = now
        return slot.applies

    def idle_seconds(self) -> float | None:
        now = self.clock()
        applicable = False
        for slot in self.slots:
            if not self._applies(slot, now):
                continue
            applicable = True
            if now < slot.retry_at:
                continue
            try:
                value = slot.source.idle_seconds()
            except Exception:
                log.debug("idle source %s failed", type(slot.source).__name__, exc_info=True)
                value = None
            if value is not None:
                slot.failures, slot.retry_at = 0, 0.0
                self.last_input = time.time() - value
                return value
            slot.failures += 1
            first, longest = self.BACKOFF_S
            slot.retry_at = now + min(longest, first * 2 ** (slot.failures - 1))
            if slot.failures == 1:
                log.info("idle source %s gave no answer; not sharing until it does",
                         type(slot.source).__name__)
        if applicable or self.when_none_apply is None:
            return None
        return self.when_none_apply.idle_seconds()


def platform_sources() -> list[IdleSource]:
    """This OS's sources, best first (imported lazily: each module is one OS's)."""
    os_name = system()
    if os_name == WINDOWS:
        from engine.platform.idle_windows import WindowsSource

        return [WindowsSource()]
    if os_name == MACOS:
        from engine.platform.idle_macos import MacSource

        return [MacSource()]
    from engine.platform.idle_linux import LogindSource, X11Source

    return [LogindSource(), X11Source()]


def default_idle_source() -> IdleSource:
    chain = FirstOf(platform_sources())
    chain.when_none_apply = NoUserSource(since=lambda: chain.last_input)
    return chain


def idle_source_from_spec(spec: str | None) -> IdleSource:
    """CLI form: None/"auto" = platform sources; "file:PATH"; "none" = no user."""
    if spec in (None, "", "auto"):
        return default_idle_source()
    if spec == "none":
        return NoUserSource()
    if spec.startswith("file:"):
        return FileIdleSource(spec[5:])
    raise ValueError(f"unknown idle source {spec!r} (auto, none or file:PATH)")
