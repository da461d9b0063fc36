"""Starting a stage worker process and learning where it listens: the one copy.

Every place that runs `python -m engine.shards.worker` on this PC (the local
runner, the warm standby, the fleet's fallback onto this PC, benchmarks) starts it
with spawn() -- this checkout on its PYTHONPATH, its stderr appended to a log file,
its own process group, ended with its parent (die_with_us) -- and waits for the
one JSON line the worker prints once bound ({"event": "bound", "endpoint": ...})
with read_bound(). A worker that exits or stays silent is a WorkerStartError that
says which, with the last line of its log. (An agent's workers are started by
engine/fleet/workers.py on the agent's own asyncio loop; it reads the same line
with parse_bound().)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

from engine.platform import process

WORKER_MODULE = "engine.shards.worker"
REPO_ROOT = Path(__file__).resolve().parents[2]
BOUND_TIMEOUT_S = 60.0  # a worker must report its address within this (python + openvino import)


class WorkerStartError(RuntimeError):
    """A worker did not come up. code: "timeout" (said nothing in time), "exited" (ended
    while starting) or "no_address" (its first line named no endpoint)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def worker_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child that imports this checkout: base (os.environ) with the
    repository first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def worker_command(shard: Path, bind: str, name: str, device: str, cache_dir: Path, *, exact: bool = False,
                   kv_precision: str = "", threads: int | None = None, curve: Path | None = None) -> list[str]:
    """The shard worker's command line as this PC starts one (the local runner, a fleet's
    stage recovered onto this PC): exact mode or a KV precision, threads, CURVE setup."""
    cmd = [sys.executable, "-m", WORKER_MODULE, "--shard", str(shard), "--bind", bind, "--name", name,
           "--device", device, "--cache-dir", str(cache_dir), "--parent-pid", str(os.getpid())]
    if exact:
        cmd.append("--exact")
    elif kv_precision:
        cmd += ["--kv-precision", kv_precision]
    if threads:
        cmd += ["--threads", str(threads)]
    if curve is not None:
        cmd += ["--curve", str(curve)]
    return cmd


def spawn(cmd: Sequence[str], log_path: Path, *, stdin: Any = subprocess.DEVNULL,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start cmd (a worker, or a standby that becomes one) with stdout piped for read_bound,
    stderr appended to log_path, in its own process group, ended with this process."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as logf:  # the child has its own descriptor
        return process.spawn(list(cmd), stdin=stdin, stdout=subprocess.PIPE, stderr=logf,
                             env=env if env is not None else worker_env(), cwd=str(REPO_ROOT), die_with_us=True)


def parse_bound(line: bytes | str) -> str | None:
    """The endpoint of a worker's "bound" line, or None when the line is not one."""
    try:
        event = json.loads(line)
    except (ValueError, TypeError):
        return None
    endpoint = event.get("endpoint") if isinstance(event, dict) else None
    return str(endpoint) if endpoint else None


def read_bound(proc: subprocess.Popen, label: str, log_path: Path | None,
               timeout: float = BOUND_TIMEOUT_S) -> str:
    """Wait for the worker's first stdout line and return the endpoint it names; then close
    its stdout (it prints nothing else). A thread reads it: select() on pipes does not exist
    on Windows."""
    line: list[bytes] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not line:
        raise WorkerStartError(f"{label} did not start within {timeout:.0f} s (log: {log_path})", "timeout")
    proc.stdout.close()
    if not line[0]:
        code = proc.wait(timeout=5)
        raise WorkerStartError(f"{label} {describe_exit(code)} while starting: "
                               f"{log_tail(log_path) or 'no output'} (log: {log_path})", "exited")
    endpoint = parse_bound(line[0])
    if endpoint is None:
        raise WorkerStartError(f"{label} printed no address (log: {log_path})", "no_address")
    return endpoint


def describe_exit(code: int) -> str:
    """How a process ended, in words ("exited with signal 9 (SIGKILL)")."""
    if code < 0:
        try:
            return f"exited with signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exited with signal {-code}"
    return f"exited with code {code}"


def log_tail(path: Path | None, limit: int = 200) -> str:
    """The last non-blank line of a log, on one line (what a crash report quotes)."""
    if path is None:
        return ""
    try:
        lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " ".join(lines[-1].split())[:limit] if lines else ""
