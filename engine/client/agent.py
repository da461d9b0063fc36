"""This PC's agent as its tray drives it (AgentHandle), and what the tray shows of it."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from engine.client.settings import config_dir, load_sharing_policy, save_sharing_policy
from engine.core.interface import EngineError

if TYPE_CHECKING:
    import collections
    import subprocess

    from engine.protocol.control import AgentInfo, AgentUp


@dataclass(frozen=True)
class PairingRequest:
    """A controller asking to use this PC, waiting for its owner's yes."""

    name: str  # what the controller calls itself
    fingerprint: str  # of its key (16 hex)
    code: str  # the 6 digits its screen shows; accept only if they match
    age_s: float  # seconds since it asked (requests expire after 10 minutes)


@dataclass(frozen=True)
class PairedController:
    name: str
    fingerprint: str


@dataclass(frozen=True)
class AgentState:
    """What the tray shows about this PC's agent."""

    state: str  # "idle" | "sharing" | "busy" | "paused" | "stopped"
    summary: str  # one line for the tooltip and the menu's header
    running: bool  # the agent answered on its info port
    workers: int  # shard workers running for controllers (-1 = unknown)
    share_now: bool  # "Share now" is on (the idle wait is skipped)
    paused: bool  # the owner switched sharing off
    pending: tuple[PairingRequest, ...]  # pairing requests waiting, oldest first
    paired: tuple[PairedController, ...]  # controllers allowed to use this PC


TRAY_FILE = "tray.json"  # the tray's own memory (the idle wait before "Share now")


class AgentHandle:
    """This PC's agent as its tray drives it: the same files and ports
    `flotilla agent pair/policy` use (the pairing book, sharing_policy.json),
    plus the agent's plaintext info port for its live state. No pairing with
    itself: the tray is the owner's UI, with the owner's file access.

    Blocking methods: call them on the app's Runner."""

    def __init__(self, config: Path | None = None, *, info_port: int | None = None,
                 host: str = "127.0.0.1", pid: int | None = None) -> None:
        from engine.fleet.discovery import DEFAULT_BASE_PORT, INFO_OFFSET

        self.config = Path(config) if config else config_dir()
        self.info_port = info_port or DEFAULT_BASE_PORT + INFO_OFFSET
        self.host = host
        self.pid = pid  # the agent's process: its children are the shard workers
        self.proc: subprocess.Popen | None = None  # set by spawn(): the agent child process
        self.lines: collections.deque[str] | None = None  # its last stderr lines (spawn)

    @classmethod
    def spawn(cls, argv: Sequence[str] = (), timeout: float = 60.0,
              config: Path | None = None) -> "AgentHandle":
        """Start `flotilla agent --headless ARGV` as a child process and wait
        until it is up (the tray of `flotilla agent` runs the agent this way, so
        the agent never shares a process with Qt). EngineError if it does not start."""
        import collections
        import subprocess
        import sys

        args = [a for a in argv if a not in ("--headless", "-v", "--verbose", "--stdin-lifeline", "--announce")]
        env = dict(os.environ)
        if config is not None:  # another agent's config dir (demos, screenshots)
            env["FLOTILLA_CONFIG"] = str(config)
        # stdin is the agent's lifeline: stop() closes it and the agent stops cleanly (the same on
        # every OS: on Windows terminate() is TerminateProcess, which runs no cleanup); it also
        # ends when this process dies, so the agent never outlives its tray.
        from engine.platform import process

        # hidden: no console window on Windows; its own group, so a Ctrl-C meant for the tray's
        # terminal does not skip the agent's cleanup (the lifeline stops it in order instead).
        # --announce: once serving, the agent writes its ports as one AgentUp line on stdout
        proc = process.spawn([sys.executable, "-m", "engine.cli.agent_cmd", "--headless", "-v",
                              "--stdin-lifeline", "--announce", *args], hidden=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
        lines: collections.deque[str] = collections.deque(maxlen=200)
        up = threading.Event()
        announced: list[AgentUp] = []  # the AgentUp, once read

        def log_pump() -> None:  # its log, for the error below and the tray's view; read to the end
            for line in proc.stderr:
                lines.append(line.rstrip())
            up.set()  # the agent ended: stop waiting

        def announce_pump() -> None:  # its stdout, read to the end so it never fills
            from engine.protocol.control import AgentUp
            from engine.protocol.errors import ProtocolError

            for line in proc.stdout:
                if announced:
                    continue
                try:
                    msg = AgentUp.from_line(line)
                except ProtocolError as e:
                    lines.append(f"unreadable agent_up line: {e}")
                    msg = None
                if msg is not None:
                    announced.append(msg)
                    up.set()
            up.set()

        threading.Thread(target=log_pump, name="flotilla-agent-log", daemon=True).start()
        threading.Thread(target=announce_pump, name="flotilla-agent-announce", daemon=True).start()
        if not up.wait(timeout) or not announced:
            from engine.platform.process import kill_tree

            kill_tree(proc)  # and whatever it started
            proc.wait(5)
            raise EngineError("the agent did not start: " + (" | ".join(list(lines)[-5:]) or "no output"))
        handle = cls(config, info_port=announced[0].info_port, pid=proc.pid)
        handle.proc, handle.lines = proc, lines
        return handle

    # -- reading ------------------------------------------------------------------
    def state(self, timeout: float = 1.0) -> AgentState:
        from engine.transport.security import PairingBook, fingerprint

        info, running = self._info(timeout), False
        running = info is not None
        policy = load_sharing_policy(self.config)
        tray = self._tray()
        book = PairingBook(self.config)
        allowed = book.allowed.entries()
        dismissed = {**tray.get("dismissed", {}), **allowed}  # accepted ones stay in the agent's file
        now = time.time()
        pending = tuple(sorted(
            (PairingRequest(str(v.get("name", "controller")), fingerprint(k), str(v.get("code", "")),
                            max(0.0, now - float(v.get("time", now))))
             for k, v in book.pending().items() if k not in dismissed),
            key=lambda r: -r.age_s))
        paired = tuple(PairedController(str(v.get("name", "controller")), fingerprint(k))
                       for k, v in allowed.items())
        workers = self._workers()
        paused = not policy.get("enabled", True)
        share_now = bool(tray.get("share_now")) and not paused
        on_battery = info is not None and info.on_ac is False and policy.get("require_ac", True)
        if not running:
            state, summary = "stopped", "The agent is not running"
        elif paused:
            state, summary = "paused", "Paused: this PC is not shared"
        elif workers > 0:
            state, summary = "busy", f"Busy: {workers} shard worker{'s' if workers != 1 else ''} running"
        elif on_battery:
            state, summary = "idle", "Not sharing: on battery"
        elif info.idle:
            state, summary = "sharing", ("Sharing now (Share now is on)" if share_now
                                         else "Sharing: you are away, the fleet may use this PC")
        else:
            mins = float(policy.get("idle_minutes", 5))
            state, summary = "idle", f"Not sharing: you are using this PC (shares after {mins:g} min idle)"
        if pending:
            summary += f" · {len(pending)} pairing request{'s' if len(pending) != 1 else ''}"
        return AgentState(state, summary, running, workers, share_now, paused, pending, paired)

    def _info(self, timeout: float) -> AgentInfo | None:
        import zmq.asyncio

        from engine import aio
        from engine.fleet.discovery import async_query_info

        async def ask() -> AgentInfo | None:
            ctx = zmq.asyncio.Context()
            try:
                return await async_query_info(ctx, self.host, self.info_port, timeout=timeout)
            finally:
                ctx.term()

        try:
            return aio.run(ask())
        except Exception:
            return None

    def _workers(self) -> int:
        if self.pid is None:
            return -1
        try:
            import psutil

            return sum(1 for c in psutil.Process(self.pid).children() if c.status() != psutil.STATUS_ZOMBIE)
        except Exception:
            return 0

    def _tray(self) -> dict:
        from engine.fleet.paths import read_json

        data = read_json(self.config / TRAY_FILE, {})
        return data if isinstance(data, dict) else {}

    def _save_tray(self, data: dict) -> None:
        from engine.fleet.paths import write_json

        write_json(self.config / TRAY_FILE, data)

    # -- pairing ------------------------------------------------------------------
    def accept(self, code: str) -> str:
        """Allow the pending controller showing `code`; its name. EngineError if none does."""
        from engine.transport.security import PairingBook

        try:
            return PairingBook(self.config).accept(code)
        except LookupError as e:
            raise EngineError(str(e)) from None

    def deny(self, code: str) -> None:
        """Refuse a pending request: it is not paired (nothing to undo) and the
        tray stops showing it; it expires on the agent after 10 minutes."""
        from engine.transport.security import PENDING_TTL_S, PairingBook

        tray = self._tray()
        now = time.time()
        dismissed = {k: t for k, t in tray.get("dismissed", {}).items() if now - t < PENDING_TTL_S}
        for key, entry in PairingBook(self.config).pending().items():
            if entry.get("code") == code:
                dismissed[key] = now
        tray["dismissed"] = dismissed
        self._save_tray(tray)

    def revoke(self, fingerprint_or_name: str) -> list[str]:
        """Forget a paired controller (new and open connections are refused from now on)."""
        from engine.transport.security import PairingBook

        return PairingBook(self.config).allowed.revoke(fingerprint_or_name)

    # -- sharing ------------------------------------------------------------------
    def pause(self, paused: bool = True) -> None:
        """Switch sharing off (running shard workers stop within 2 s) or back on."""
        policy = load_sharing_policy(self.config)
        policy["enabled"] = not paused
        save_sharing_policy(policy, self.config)

    def share_now(self, on: bool = True) -> None:
        """Lend the PC now, without waiting for the idle time (on), or go back
        to the policy's idle wait (off). Also un-pauses."""
        policy = load_sharing_policy(self.config)
        tray = self._tray()
        if on:
            if not tray.get("share_now"):
                tray["idle_minutes_before"] = policy.get("idle_minutes", 5.0)
            policy.update(enabled=True, idle_minutes=0.0)
            tray["share_now"] = True
        else:
            policy["idle_minutes"] = float(tray.pop("idle_minutes_before", 5.0) or 0.0) \
                if tray.get("share_now") else policy.get("idle_minutes", 5.0)
            tray["share_now"] = False
        save_sharing_policy(policy, self.config)
        self._save_tray(tray)

    def load_policy(self) -> dict:
        return load_sharing_policy(self.config)

    def save_policy(self, policy: dict) -> Path:
        return save_sharing_policy(policy, self.config)

    # -- the process ----------------------------------------------------------------
    def stop(self, timeout: float = 10.0) -> None:
        """Stop the agent this handle started and wait for it: it is asked first -- its stdin
        closes, and the agent stops its shard workers, says goodbye on mDNS and exits -- and
        only killed, with its workers, when it is still running `timeout` s later."""
        from engine.platform.process import stop as stop_process

        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        stop_process(proc, timeout, ask=lambda: _close_lifeline(proc))

    def wait(self) -> int:
        return int(self.proc.wait()) if self.proc is not None else 0


def _close_lifeline(proc: subprocess.Popen) -> None:
    """Close the agent's stdin (AgentHandle.spawn gave it --stdin-lifeline): its request to stop.
    An agent started otherwise (no pipe) gets the OS's graceful stop instead."""
    if proc.stdin is None:
        from engine.platform.process import interrupt

        interrupt(proc)
        return
    try:
        proc.stdin.close()
    except OSError:
        pass
