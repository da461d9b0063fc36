"""Shard worker child processes: start from a command template, stop fast.

The command is a template (a list of strings) with these placeholders:
  {python} this interpreter   {shard} the shard (folder, or file if not a bundle)
  {sha256} the shard's hash   {device} OpenVINO device   {port} data-plane port (0 = any)
  {bind}   the data-plane endpoint to bind, tcp://HOST:PORT (PORT * when port is 0)
  {cache}  compiled-blob cache folder   {parent} the agent's pid (workers exit with it)
  {curve}  the worker's CURVE setup file (engine/transport/curve_data.py)
  {exact}  "--exact" for f32 inference, else the argument is dropped
  {kv}     "--kv-precision=P" for a KV cache precision other than the device's default
           (LoadRequest.kv_precision), else the argument is dropped
The agent's default is pipeline_worker_command(), the real pipeline worker
(engine/shards/worker.py); `flotilla agent --worker-cmd` and
AgentConfig.worker_command replace it (tests use a tiny worker of their own).

A worker may print one JSON line first on stdout, {"event": "bound",
"endpoint": "tcp://HOST:PORT"}: the agent waits for that line (or the first
line of any kind, or BOUND_WAIT_S) and reports the port in LoadReply, so a
controller can let the worker pick a free port on a PC it cannot see into.

Workers run in their own process group with their output in a log file, and
are stopped gracefully (engine/platform/process.py: SIGTERM to the group on
POSIX, CTRL_BREAK_EVENT on Windows), then killed with their children after a
grace period, so a yield to the returning user completes within 2 s even if a
worker hangs. On Windows they are also in the agent's kill-on-close Job object:
they die with the agent even when it is killed outright.

No asyncio subprocesses (a selector loop cannot run them on Windows, and
engine/aio.py runs one on every OS): workers are plain subprocess.Popen; one
thread per worker reads its stdout, another waits for its exit, and both hand
what they see to the event loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from engine.platform import process
from engine.protocol.control import ShardInfo
from engine.shards.worker_process import WORKER_MODULE, parse_bound

log = logging.getLogger(__name__)
STOP_GRACE_S = 0.6  # graceful stop -> kill; with the 0.5 s poll a yield stays well inside 2 s
BOUND_WAIT_S = 60.0  # wait this long for a worker's first stdout line (python + imports)
EXIT_SETTLE_S = 1.0  # a worker whose stdout ended: wait this long for its exit to be reported
KILL_REAP_S = 5.0  # after a kill, wait this long for the exit to be reported


def pipeline_worker_command() -> list[str]:
    """The real shard worker (engine/shards/worker.py), CURVE on its data plane."""
    return ["{python}", "-m", WORKER_MODULE, "--shard", "{shard}", "--device", "{device}",
            "--bind", "{bind}", "--cache-dir", "{cache}", "--parent-pid", "{parent}",
            "--curve", "{curve}", "{exact}", "{kv}"]


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
    kv_precision: str = ""  # the worker's KV cache precision; "" = the device's default


def render_command(template: Sequence[str], *, shard: Path, sha256: str, device: str,
                   port: int, bind_host: str = "*", exact: bool = False, curve: Path | None = None,
                   cache: Path | None = None, kv_precision: str = "") -> list[str]:
    values = {"python": sys.executable, "shard": str(shard), "sha256": sha256,
              "device": device, "port": str(port), "bind": f"tcp://{bind_host}:{port or '*'}",
              "cache": str(cache or ""), "parent": str(os.getpid()), "curve": str(curve or ""),
              "exact": "--exact" if exact else "",
              "kv": f"--kv-precision={kv_precision}" if kv_precision else ""}
    # format_map on each argument alone: a value can never inject extra arguments.
    # An argument that renders empty ("{exact}" when not exact, "{kv}" at the default) is dropped.
    out = [arg.format_map(values) for arg in template]
    return [a for a, t in zip(out, template) if a or not t]


@dataclass
class Worker:
    shard_id: str
    sha256: str
    size: int
    device: str
    proc: subprocess.Popen
    started: float = field(default_factory=time.time)
    exit_code: int | None = None
    stopping: bool = False  # we asked it to stop (not an exit to report)
    data_port: int = 0  # the port its data socket bound, as it reported; 0 = unknown
    options: LaunchOptions = field(default_factory=LaunchOptions)  # how it was started
    done: asyncio.Future | None = field(default=None, repr=False)  # resolves with the exit code, on the loop

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
                              cache=opts.cache, kv_precision=opts.kv_precision)
        log_path = self.log_dir / f"worker-{sha256[:12]}.log"
        loop = asyncio.get_running_loop()
        with open(log_path, "ab") as logfile:  # the child has its own descriptor
            proc = process.spawn(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=logfile,
                                 die_with_us=True)
        worker = Worker(shard_id, sha256, size, device, proc, options=opts, done=loop.create_future())
        self.workers[sha256] = worker
        log.info("started worker pid %d for %s on %s: %s", proc.pid, shard_id, device, argv)
        first: asyncio.Future[bytes] = loop.create_future()
        assert proc.stdout is not None
        threading.Thread(target=_pump_stdout, args=(proc.stdout, log_path, loop, first),
                         name=f"worker-{proc.pid}-out", daemon=True).start()
        threading.Thread(target=_wait_exit, args=(proc, loop, lambda code: self._exited(worker, code)),
                         name=f"worker-{proc.pid}-wait", daemon=True).start()
        worker.data_port = await self._first_line(worker, first, port)
        return worker

    async def _first_line(self, worker: Worker, first: asyncio.Future[bytes], port: int) -> int:
        """Wait for the worker's first stdout line; the port it bound (else port).
        The rest of its stdout goes to its log (the reader thread copies it)."""
        try:
            line = await asyncio.wait_for(asyncio.shield(first), BOUND_WAIT_S)
        except asyncio.TimeoutError:
            line = b""
            log.warning("worker pid %d said nothing within %.0f s", worker.proc.pid, BOUND_WAIT_S)
        if not line and worker.done is not None:  # stdout ended: it is exiting; let the exit be seen
            try:
                await asyncio.wait_for(asyncio.shield(worker.done), EXIT_SETTLE_S)
            except asyncio.TimeoutError:
                pass
        bound, endpoint = port, parse_bound(line)
        try:
            bound = int(endpoint.rsplit(":", 1)[1]) if endpoint else port
        except (ValueError, IndexError):
            pass
        return bound if 0 < bound < 65536 else port

    def _exited(self, worker: Worker, code: int) -> None:
        """On the loop: the worker's exit, as its waiting thread saw it."""
        worker.exit_code = code
        if worker.done is not None and not worker.done.done():
            worker.done.set_result(code)
        log.info("worker pid %d (%s) exited with %d", worker.proc.pid, worker.shard_id, code)
        if not worker.stopping and self.on_exit:
            self.on_exit(worker)

    async def stop(self, sha256: str, grace: float = STOP_GRACE_S) -> Worker | None:
        worker = self.workers.get(sha256)
        if worker is None:
            return None
        if worker.exit_code is None:
            worker.stopping = True
            assert worker.done is not None
            process.interrupt(worker.proc)
            try:
                await asyncio.wait_for(asyncio.shield(worker.done), grace)
            except asyncio.TimeoutError:
                process.kill_tree(worker.proc)
                try:
                    await asyncio.wait_for(asyncio.shield(worker.done), KILL_REAP_S)
                except asyncio.TimeoutError:
                    log.error("worker pid %d did not exit after a kill", worker.proc.pid)
            if worker.exit_code is None:
                worker.exit_code = worker.proc.returncode
        return worker

    async def stop_all(self, grace: float = STOP_GRACE_S) -> list[Worker]:
        running = self.running()
        await asyncio.gather(*(self.stop(w.sha256, grace) for w in running))
        return running


def _hand_over(loop: asyncio.AbstractEventLoop, fn: Callable, *args: object) -> None:
    """fn(*args) on the loop, from a thread; dropped when the loop is already closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _set_once(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _pump_stdout(stdout: IO[bytes], log_path: Path, loop: asyncio.AbstractEventLoop,
                 first: asyncio.Future[bytes]) -> None:
    """A worker's stdout (thread): the first line to the loop, then everything to its log
    (a pipe nobody reads would block the worker)."""
    try:
        line = stdout.readline()
        _hand_over(loop, _set_once, first, line)
        with open(log_path, "ab") as f:
            f.write(line)
            f.flush()
            while chunk := stdout.read1(65536):
                f.write(chunk)
                f.flush()
    except (OSError, ValueError):
        _hand_over(loop, _set_once, first, b"")
    finally:
        stdout.close()


def _wait_exit(proc: subprocess.Popen, loop: asyncio.AbstractEventLoop, on_exit: Callable[[int], None]) -> None:
    """Wait for the worker's exit (thread) and report its code on the loop."""
    code = proc.wait()
    _hand_over(loop, on_exit, code)
