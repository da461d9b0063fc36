"""Shard worker child processes: start from a command template, stop fast.

The command is a template (a list of strings) with these placeholders:
  {python} this interpreter   {shard} path of the cached shard file
  {sha256} the shard's hash   {device} OpenVINO device   {port} data-plane port
The agent's default is pipeline_worker_command(); `flotilla agent
--worker-cmd` and AgentConfig.worker_command replace it (tests use a tiny
worker script of their own).

Workers run in their own process group with their output in a log file, and
are stopped with SIGTERM, then SIGKILL after a grace period, so a yield to the
returning user completes within 2 s even if a worker hangs.
"""

from __future__ import annotations

import asyncio
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


def pipeline_worker_command() -> list[str]:
    """HOOKUP POINT for engine/pipeline/worker.py (written separately; not in
    the tree yet). When it lands, make these flags match its CLI. Everything
    else (spawn, logs, stop, yield, status) is already wired to whatever this
    returns."""
    return ["{python}", "-m", "engine.pipeline.worker", "--shard", "{shard}",
            "--device", "{device}", "--port", "{port}"]


def render_command(template: Sequence[str], *, shard: Path, sha256: str, device: str,
                   port: int) -> list[str]:
    values = {"python": sys.executable, "shard": str(shard), "sha256": sha256,
              "device": device, "port": str(port)}
    # format_map on each argument alone: a value can never inject extra arguments.
    return [arg.format_map(values) for arg in template]


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
                    port: int) -> Worker:
        old = self.workers.get(sha256)
        if old and old.exit_code is None:
            return old  # idempotent: one worker per shard
        argv = render_command(self.template, shard=shard, sha256=sha256, device=device, port=port)
        logfile = open(self.log_dir / f"worker-{sha256[:12]}.log", "ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=logfile, stderr=logfile,
                start_new_session=(os.name == "posix"))
        finally:
            logfile.close()  # the child has its own descriptor
        worker = Worker(shard_id, sha256, size, device, proc)
        self.workers[sha256] = worker
        asyncio.get_running_loop().create_task(self._reap(worker))
        log.info("started worker pid %d for %s on %s: %s", proc.pid, shard_id, device, argv)
        return worker

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


def _signal_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    try:
        if os.name == "posix":
            os.killpg(proc.pid, sig)  # the worker's own children too
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
