"""A benchmark's helper process: the parent's handle on it (Child: one JSON command per
line, one JSON answer per line), the child's side of that protocol (answer_commands),
and stopping a process group. `flotilla bench pipeline` runs its models and rings in
such children (engine/bench/_pipeline_child_main.py), `flotilla bench serve` its
client (engine/bench/_serve_client.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class Child:
    """A helper process answering one JSON command per line: `module`'s main(), which
    serves them with answer_commands. spec: the first command, which sets the child up
    (None: none). log_path: the child's stderr (None: ours)."""

    def __init__(self, prefix: list[str], spec: dict | None, log_path: Path | None,
                 module: str = "engine.bench._pipeline_child_main"):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        cmd = [*prefix, sys.executable, "-c", f"from {module} import main; main()"]
        self.log_path = log_path
        self._log = open(log_path, "ab") if log_path is not None else None
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=env, cwd=str(REPO_ROOT), start_new_session=True, text=True)
        try:
            self.setup = self.ask(spec) if spec is not None else None  # it answers when loaded
        except BaseException:
            self.close()
            raise

    def ask(self, cmd: dict) -> dict:
        self.send(cmd)
        return self.recv()

    def send(self, cmd: dict) -> None:
        assert self.proc.stdin
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict:
        assert self.proc.stdout
        line = self.proc.stdout.readline()
        where = f"log: {self.log_path}" if self.log_path is not None else "its errors are above"
        if not line:
            self.proc.wait(timeout=10)
            raise RuntimeError(f"benchmark child exited ({self.proc.returncode}); {where}\n"
                               + (tail(self.log_path) if self.log_path is not None else ""))
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"benchmark child: {answer['error']} ({where})")
        return answer

    def close(self) -> None:
        """Ask the child to quit (it stops what it started), then make sure it is gone.

        Never waits for an answer: close() also runs when a command was interrupted.
        The child's workers and relays exit by themselves when the child is gone.
        """
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()  # EOF: the child tears down after its current command
            except (OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        stop_group(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._log is not None:
            self._log.close()


def answer_commands(handle: Callable[[dict], dict]) -> None:
    """The child's side of Child: answer each JSON command on stdin with handle(command)
    (an exception: {"error": ...}, its traceback on stderr) until {"cmd": "quit"} or EOF.
    The answers alone go to stdout; anything else printed goes to stderr."""
    import logging
    import traceback

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            answer = handle(cmd)
        except Exception as e:  # reported to the parent, which raises
            traceback.print_exc()
            answer = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()
        if cmd.get("cmd") == "quit":
            break


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def stop_group(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """SIGTERM the process group (its own session), then SIGKILL what is left."""
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
