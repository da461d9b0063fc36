"""The parent's handle on a `flotilla bench pipeline` helper process (Child: one JSON
command per line, answered by engine/bench/_pipeline_child_main.py), and stopping a
process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class Child:
    """A helper process answering one JSON command per line (see engine/bench/_pipeline_child_main.py)."""

    def __init__(self, prefix: list[str], spec: dict, log_path: Path):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        cmd = [*prefix, sys.executable, "-c", "from engine.bench._pipeline_child_main import main; main()"]
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=env, cwd=str(REPO_ROOT), start_new_session=True, text=True)
        try:
            self.setup = self.ask(spec)  # the first command sets the child up; it answers when loaded
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
        if not line:
            self.proc.wait(timeout=10)
            raise RuntimeError(f"benchmark child exited ({self.proc.returncode}); log: {self.log_path}\n"
                               + tail(self.log_path))
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"benchmark child: {answer['error']} (log: {self.log_path})")
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
        self._log.close()


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
