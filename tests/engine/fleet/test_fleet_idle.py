"""engine/fleet/idle.py and engine/platform/idle_*.py: a failed idle probe never lends
the PC (unknown, retried with backoff); only a machine where no source applies is idle.
OS calls are faked, so the Windows and macOS branches run here."""

from __future__ import annotations

import ctypes
import sys
import time

import psutil
import pytest

from engine.fleet import idle as idle_mod
from engine.fleet.idle import FirstOf, FunctionIdleSource, NoUserSource, default_idle_source
from engine.fleet.policy import MachineState, SharingPolicy, evaluate
from engine.platform import idle_linux, idle_macos, idle_windows

HOUR = 3600.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Flaky:
    """Answers `value` when told to, else raises (a probe that breaks now and then)."""

    def __init__(self, value: float) -> None:
        self.value, self.ok, self.calls = value, True, 0

    def applies(self) -> bool:
        return True

    def idle_seconds(self) -> float:
        self.calls += 1
        if not self.ok:
            raise OSError("probe failed")
        return self.value


def _lends(idle_s: float | None) -> bool:
    """Would the sharing policy lend the PC with this idle figure?"""
    state = MachineState(idle_s, True, 16 << 30, 12 << 30, 0.0, time.time())
    return evaluate(SharingPolicy(idle_minutes=5), state).share


def test_a_flaky_source_never_yields_idle_on_its_failure():
    clock, src = Clock(), Flaky(2 * HOUR)
    chain = FirstOf([src], when_none_apply=NoUserSource(), clock=clock)
    seen = []
    for step in range(400):  # 200 s of the agent's half-second beat, the probe failing 2 of 3 times
        src.ok = step % 3 == 0
        value = chain.idle_seconds()
        seen.append(value)
        if not src.ok:
            assert value is None, f"step {step}: a failed probe said idle {value} s"  # not the no-user fallback
        clock.t += 0.5
    assert None in seen and src.value in seen  # it failed and recovered
    assert all(v in (None, src.value) for v in seen)
    assert not _lends(None)


def test_a_failed_probe_is_retried_with_backoff_and_meanwhile_not_idle():
    clock, src = Clock(), Flaky(HOUR)
    chain = FirstOf([src], when_none_apply=NoUserSource(), clock=clock)
    src.ok = False
    calls_at = []
    for _ in range(int(200 / 0.25)):
        before = src.calls
        assert chain.idle_seconds() is None
        if src.calls > before:
            calls_at.append(clock.t - 1000.0)
        clock.t += 0.25
    gaps = [b - a for a, b in zip(calls_at, calls_at[1:])]
    assert gaps[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0] and all(g == 60.0 for g in gaps[6:])
    src.ok = True
    clock.t += 60.0
    assert chain.idle_seconds() == HOUR  # recovered: read again after the backoff
    clock.t += 0.5
    assert chain.idle_seconds() == HOUR and src.calls == len(calls_at) + 2  # and read on every beat again


def test_a_source_saying_none_counts_as_a_failure_not_as_no_user():
    chain = FirstOf([FunctionIdleSource(lambda: None)], when_none_apply=NoUserSource(), clock=Clock())
    assert chain.idle_seconds() is None


def test_an_applies_check_that_breaks_counts_as_a_user():
    def broken() -> bool:
        raise OSError("cannot ask")

    chain = FirstOf([FunctionIdleSource(lambda: None, applies=broken)], when_none_apply=NoUserSource(),
                    clock=Clock())
    assert chain.idle_seconds() is None


def test_a_later_source_answers_while_the_first_is_broken():
    clock, first = Clock(), Flaky(HOUR)
    first.ok = False
    chain = FirstOf([first, FunctionIdleSource(lambda: 12.0)], when_none_apply=NoUserSource(), clock=clock)
    assert chain.idle_seconds() == 12.0


def test_only_a_machine_where_no_source_applies_is_idle(monkeypatch):
    clock = Clock()
    present = {"on": False}
    src = FunctionIdleSource(lambda: 30.0, applies=lambda: present["on"])
    chain = FirstOf([src], clock=clock)
    chain.when_none_apply = NoUserSource(since=lambda: chain.last_input)
    boot = time.time() - psutil.boot_time()
    assert chain.idle_seconds() >= boot - 1  # headless: idle since boot
    present["on"] = True  # a user logs in; applies() is asked again within RECHECK_S
    clock.t += FirstOf.RECHECK_S
    assert chain.idle_seconds() == 30.0
    present["on"] = False  # ... and logs out: idle since the input we saw, not since boot
    clock.t += FirstOf.RECHECK_S
    assert 29.0 <= chain.idle_seconds() <= 40.0


# ------------------------------------------------------------------- platform sources


class _FakeUser32:
    def __init__(self, ok: bool, last_ms: int) -> None:
        self.ok, self.last_ms = ok, last_ms

    def GetLastInputInfo(self, ref) -> int:  # noqa: N802 (the Windows API's name)
        ctypes.cast(ref, ctypes.POINTER(idle_windows.LASTINPUTINFO)).contents.dwTime = self.last_ms
        return 1 if self.ok else 0


class _FakeKernel32:
    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def GetTickCount(self) -> int:  # noqa: N802
        return self.now_ms


def test_windows_source_reads_last_input_and_raises_when_the_call_fails(monkeypatch):
    api = [_FakeUser32(True, 0xFFFFF000), _FakeKernel32(0x00001000)]  # the tick count wrapped in between
    monkeypatch.setattr(idle_windows, "_api", lambda: tuple(api))
    src = idle_windows.WindowsSource()
    assert src.applies() and src.idle_seconds() == pytest.approx(0x2000 / 1000.0)
    api[0] = _FakeUser32(False, 0)
    with pytest.raises(OSError):
        src.idle_seconds()
    chain = FirstOf([src], when_none_apply=NoUserSource(), clock=Clock())
    assert chain.idle_seconds() is None  # the bug this fixes: it used to fall back to idle since boot


def test_macos_source_parses_ioreg_and_fails_without_hid_idle_time(monkeypatch):
    out = {"text": '    | |   "HIDIdleTime" = 734000000000\n    | |   "HIDKeyboard" = 1\n'}
    monkeypatch.setattr(idle_macos, "_ioreg", lambda: out["text"])
    src = idle_macos.MacSource()
    assert src.idle_seconds() == pytest.approx(734.0)
    out["text"] = "no such key\n"
    with pytest.raises(OSError):
        src.idle_seconds()


def test_logind_source(monkeypatch):
    answers = {
        ("list-sessions",): "3 1000 alice seat0 tty2\n7 1001 bob - pts/1\n",
        ("show-session", "3", "-p", "Type"): "wayland\n",
        ("show-session", "7", "-p", "Type"): "tty\n",
    }
    idle_hint = {"text": f"IdleHint=yes\nIdleSinceHint={int((time.time() - 120) * 1e6)}\n"}

    def run(cmd: list[str]) -> str:
        args = cmd[1:]
        if args[:3] == ["show-session", "3", "-p"] and "IdleHint" in args:
            return idle_hint["text"]
        for key, text in answers.items():
            if tuple(args[:len(key)]) == key:
                return text
        raise OSError("loginctl exited with 1")

    monkeypatch.setattr(idle_linux, "_run", run)
    monkeypatch.setattr(idle_linux.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.delenv("XDG_SESSION_ID", raising=False)
    src = idle_linux.LogindSource()
    assert src.applies() and src.session == "3"  # the graphical one, not bob's ssh session
    assert 119.0 <= src.idle_seconds() <= 125.0
    idle_hint["text"] = "IdleHint=no\nIdleSinceHint=0\n"
    assert src.idle_seconds() == 0.0
    idle_hint["text"] = ""
    assert src.idle_seconds() is None

    def no_logind(cmd: list[str]) -> str:
        raise OSError("loginctl exited with 1")

    monkeypatch.setattr(idle_linux, "_run", no_logind)  # installed, not running (a container): no user here
    assert not idle_linux.LogindSource().applies()


def test_x11_source_applies_only_with_a_display(monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    assert not idle_linux.X11Source().applies()
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setattr(idle_linux.shutil, "which", lambda name: "/usr/bin/xprintidle")
    monkeypatch.setattr(idle_linux, "_run", lambda cmd: "4500\n")
    src = idle_linux.X11Source()
    assert src.applies() and src.idle_seconds() == 4.5


@pytest.mark.parametrize("platform, kinds", [
    ("win32", ["WindowsSource"]), ("darwin", ["MacSource"]), ("linux", ["LogindSource", "X11Source"]),
])
def test_default_source_per_os(monkeypatch, platform, kinds):
    monkeypatch.setattr(sys, "platform", platform)
    chain = default_idle_source()
    assert isinstance(chain, FirstOf) and [type(s.source).__name__ for s in chain.slots] == kinds
    assert isinstance(chain.when_none_apply, NoUserSource)


def test_windows_default_source_fails_safe_when_the_api_breaks(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(idle_windows, "_api", lambda: (_FakeUser32(False, 0), _FakeKernel32(0)))
    chain = default_idle_source()
    assert [chain.idle_seconds() for _ in range(5)] == [None] * 5


def test_spec_forms(tmp_path):
    assert isinstance(idle_mod.idle_source_from_spec("none"), NoUserSource)
    f = tmp_path / "idle"
    f.write_text(f"{time.time() - 60}\n")
    assert 59 <= idle_mod.idle_source_from_spec(f"file:{f}").idle_seconds() <= 70
    with pytest.raises(ValueError):
        idle_mod.idle_source_from_spec("bogus")
