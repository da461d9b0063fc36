"""Shard worker child processes: start from a command template, stop fast.

The command is a template (a list of strings) with these placeholders:
  {python} this interpreter   {shard} the shard (folder, or file if not a bundle)
  {sha256} the shard's hash   {device} OpenVINO device   {port} data-plane port (0 = any)
  {bind}   the data-plane endpoint to bind, tcp://HOST:PORT (PORT * when port is 0)
  {cache}  compiled-blob cache folder   {parent} the agent's pid (workers exit with it)
  {curve}  the worker's CURVE setup file (engine/fleet/curve_data.py)
  {exact}  "--exact" for f32 inference, else the argument is dropped
The agent's default is pipeline_worker_command(), the real pipeline worker
(engine/pipeline/worker.py); `flotilla agent --worker-cmd` and
AgentConfig.worker_command replace it (tests use a tiny worker of their own).

A worker may print one JSON line first on stdout, {"event": "bound",
"endpoint": "tcp://HOST:PORT"}: the agent waits for that line (or the first
line of any kind, or BOUND_WAIT_S) and reports the port in LoadReply, so a
controller can let the worker pick a free port on a PC it cannot see into.

Workers run in their own process group with their output in a log file, and
are stopped with SIGTERM, then SIGKILL after a grace period, so a yield to the
returning user completes within 2 s even if a worker hangs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.protocol.control import ShardInfo

log = logging.getLogger(__name__)
STOP_GRACE_S = 0.6  # SIGTERM -> SIGKILL; with the 0.5 s poll a yield stays well inside 2 s
BOUND_WAIT_S = 60.0  # wait this long for a worker's first stdout line (python + imports)


def pipeline_worker_command() -> list[str]:
    """The real shard worker (engine/pipeline/worker.py), CURVE on its data plane."""
    return ["{python}", "-m", "engine.pipeline.worker", "--shard", "{shard}", "--device", "{device}",
            "--bind", "{bind}", "--cache-dir", "{cache}", "--parent-pid", "{parent}",
            "--curve", "{curve}", "{exact}"]


@dataclass(frozen=True)
class LaunchOptions:
    """How one worker is started, beyond its shard."""

    device: str = "CPU"  # OpenVINO device
    port: int = 0  # data-plane port to bind; 0 = the worker picks a free one
    bind_host: str = "*"  # address the data socket binds (the agent's --bind)
    exact: bool = False  # f32 inference + KV cache
    curve: Path | None = None  # CURVE setup file
    cache: Path | None = None  # compiled-blob cache folder
    ring_keys: tuple[str, ...] = ()  # other agents of the ring (written into the curve file)


def render_command(template: Sequence[str], *, shard: Path, sha256: str, device: str,
                   port: int, bind_host: str = "*", exact: bool = False, curve: Path | None = None,
                   cache: Path | None = None) -> list[str]:
    values = {"python": sys.executable, "shard": str(shard), "sha256": sha256,
              "device": device, "port": str(port), "bind": f"tcp://{bind_host}:{port or '*'}",
              "cache": str(cache or ""), "parent": str(os.getpid()), "curve": str(curve or ""),
              "exact": "--exact" if exact else ""}
    # format_map on each argument alone: a value can never inject extra arguments.
    # An argument that renders empty ("{exact}" when not exact) is dropped.
    out = [arg.format_map(values) for arg in template]
    return [a for a, t in zip(out, template) if a or not t]


@dataclass
class Worker:
    shard_id: str
    sha256: str
    size: int
    device: str
    proc: asyncio.subprocess.Process
    started: float = field(default_factory=time.time)
    exit_code: int | None = None
    stopping: bool = False  # we asked it to stop (not an exit to report)
    data_port: int = 0  # the port its data socket bound, as it reported; 0 = unknown
    options: LaunchOptions = field(default_factory=LaunchOptions)  # how it was started

    def info(self) -> ShardInfo:
        running = self.exit_code is None
        return ShardInfo(self.shard_id, self.sha256, self.size, self.size,
                         "running" if running else "exited",
                         self.proc.pid if running else None,
                         None if running else max(-255, min(255, self.exit_code)), self.device)


class WorkerSupervisor:
    def __init__(self, template: Sequence[str], log_dir: Path,
                 on_exit: Callable[[Worker], None] | None = None) -> None:
        self.template = list(template)
        self.log_dir = log_dir
        self.on_exit = on_exit  # called for exits we did not ask for
        self.workers: dict[str, Worker] = {}  # sha256 -> worker (running or last exited)

    def running(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.exit_code is None]

    async def start(self, shard_id: str, sha256: str, size: int, shard: Path, device: str,
                    port: int, options: LaunchOptions | None = None) -> Worker:
        opts = options or LaunchOptions(device=device, port=port)
        old = self.workers.get(sha256)
        if old and old.exit_code is None:
            if old.options == opts:
                return old  # idempotent: one worker per shard
            await self.stop(sha256)  # asked for another device, precision or ring: restart
        argv = render_command(self.template, shard=shard, sha256=sha256, device=device, port=port,
                              bind_host=opts.bind_host, exact=opts.exact, curve=opts.curve,
                              cache=opts.cache)
        log_path = self.log_dir / f"worker-{sha256[:12]}.log"
        logfile = open(log_path, "ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=logfile,
                start_new_session=(os.name == "posix"))
        finally:
            logfile.close()  # the child has its own descriptor
        worker = Worker(shard_id, sha256, size, device, proc, options=opts)
        self.workers[sha256] = worker
        log.info("started worker pid %d for %s on %s: %s", proc.pid, shard_id, device, argv)
        worker.data_port = await self._first_line(worker, log_path, port)
        asyncio.get_running_loop().create_task(self._reap(worker))
        return worker

    async def _first_line(self, worker: Worker, log_path: Path, port: int) -> int:
        """Wait for the worker's first stdout line; the port it bound (else port).
        The rest of its stdout is copied to its log."""
        assert worker.proc.stdout is not None
        try:
            line = await asyncio.wait_for(worker.proc.stdout.readline(), BOUND_WAIT_S)
        except asyncio.TimeoutError:
            line = b""
            log.warning("worker pid %d said nothing within %.0f s", worker.proc.pid, BOUND_WAIT_S)
        bound = port
        try:
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") == "bound":
                bound = int(str(event["endpoint"]).rsplit(":", 1)[1])
        except (ValueError, KeyError, IndexError, TypeError):
            pass
        asyncio.get_running_loop().create_task(_copy_rest(worker.proc.stdout, log_path, line))
        return bound if 0 < bound < 65536 else port

    async def _reap(self, worker: Worker) -> None:
        code = await worker.proc.wait()
        worker.exit_code = code
        log.info("worker pid %d (%s) exited with %d", worker.proc.pid, worker.shard_id, code)
        if not worker.stopping and self.on_exit:
            self.on_exit(worker)

    async def stop(self, sha256: str, grace: float = STOP_GRACE_S) -> Worker | None:
        worker = self.workers.get(sha256)
        if worker is None:
            return None
        if worker.exit_code is None:
            worker.stopping = True
            _signal_group(worker.proc, signal.SIGTERM)
            try:
                await asyncio.wait_for(worker.proc.wait(), grace)
            except asyncio.TimeoutError:
                _signal_group(worker.proc, getattr(signal, "SIGKILL", signal.SIGTERM))
                await worker.proc.wait()
            worker.exit_code = worker.proc.returncode
        return worker

    async def stop_all(self, grace: float = STOP_GRACE_S) -> list[Worker]:
        running = self.running()
        await asyncio.gather(*(self.stop(w.sha256, grace) for w in running))
        return running


async def _copy_rest(stream: asyncio.StreamReader, log_path: Path, first: bytes) -> None:
    """Append a worker's remaining stdout to its log (a pipe nobody reads would block it)."""
    with open(log_path, "ab") as f:
        f.write(first)
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                return
            f.write(chunk)
            f.flush()


def _signal_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    try:
        if os.name == "posix":
            os.killpg(proc.pid, sig)  # the worker's own children too
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
