"""Replacement stages for a local pipeline: warm standby workers.

    python -m engine.pipeline.standby [--parent-pid PID]

A standby process imports everything a shard worker needs (Python, numpy,
OpenVINO, zmq: the seconds a fresh worker spends before it can even bind) and
then waits for one line on stdin: the JSON argv of a shard worker (the same
arguments the lost stage was started with, so the same shard, device, CURVE
keys...). It then runs that worker: binds, prints its address, loads the
shard (compiled blob from the cache) and serves. An empty line or EOF = exit.

LocalRingProvider is the re-plan provider launch_pipeline gives the
coordinator (engine/pipeline/recovery.py): for each lost stage it hands the
stage's own arguments to a standby (or, if none is ready, starts a fresh
worker with them), waits for its address, and returns the new ring; then it
starts the next standby in the background. Retired stages are killed (with
their children). Every process it starts is in fleet.procs, so fleet.stop()
ends them all.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from engine.platform import process
from engine.shards.worker_process import WORKER_MODULE

log = logging.getLogger(__name__)


class LocalRingProvider:
    """RingProvider of a LocalFleet (engine/pipeline/runner.py)."""

    def __init__(self, fleet: Any, spares: int = 1) -> None:
        self.fleet = fleet
        self.want_spares = max(0, spares)
        self.spares: list[subprocess.Popen] = []
        self.replacements = 0  # stages started by replan()
        self.argv_of: dict[int, list[str]] = {}  # pid -> worker argv of each replacement (standbys hide it)
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(self.want_spares):
            self._start_spare()

    # -- RingProvider -------------------------------------------------------------
    def replan(self, loss: Any) -> list[Any]:
        from engine.pipeline.recovery_provider import RecoveryImpossible
        from engine.pipeline.runner import PipelineLaunchError

        links = list(loss.stages)
        for i in loss.lost:
            old = links[i]
            pid = getattr(old.proc, "pid", None)
            argv = self.argv_of.get(pid) if pid is not None else None
            argv = argv or _worker_argv(getattr(old.proc, "args", None))
            if argv is None:
                raise RecoveryImpossible(f"{old.label} was not started by this PC: nothing to restart it from")
            with self._lock:
                self.replacements += 1
                n = self.replacements
            log_path = Path(self.fleet.log_dir) / f"stage-{i}-r{n}.log"
            proc = self._take_spare(argv, log_path) or self._popen([sys.executable, "-m", WORKER_MODULE, *argv],
                                                                   log_path, stdin=subprocess.DEVNULL)
            self.argv_of[proc.pid] = argv
            link = replace(old, index=i, endpoint="", proc=proc, log_path=log_path, pid=None)
            try:
                link.endpoint = self.fleet._read_bound(link)
            except PipelineLaunchError as e:
                raise RecoveryImpossible(f"no replacement for layers {old.start}–{old.end}: {e}") from None
            links[i] = link
        threading.Thread(target=self._refill, name="pipeline-standby", daemon=True).start()
        return links

    def retire(self, links: Sequence[Any], reason: str) -> None:
        for link in links:
            proc = getattr(link, "proc", None)
            if proc is None or proc.poll() is not None:
                continue
            process.kill_tree(proc)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        self._closed = True

    # -- standby processes ----------------------------------------------------------
    def _refill(self) -> None:
        with self._lock:
            self.spares = [p for p in self.spares if p.poll() is None]
            missing = self.want_spares - len(self.spares)
        for _ in range(missing):
            self._start_spare()

    def _start_spare(self) -> None:
        if self._closed or getattr(self.fleet, "_stopped", False):
            return
        with self._lock:
            k = len(self.fleet.procs)
        log_path = Path(self.fleet.log_dir) / f"standby-{k}.log"
        proc = self._popen([sys.executable, "-m", "engine.pipeline.standby", "--parent-pid", str(os.getpid())],
                           log_path, stdin=subprocess.PIPE)
        with self._lock:
            self.spares.append(proc)

    def _take_spare(self, argv: list[str], log_path: Path) -> subprocess.Popen | None:
        while True:
            with self._lock:
                if not self.spares:
                    return None
                proc = self.spares.pop(0)
            if proc.poll() is not None:
                continue
            try:
                proc.stdin.write((json.dumps(argv) + "\n").encode())
                proc.stdin.close()
            except (OSError, ValueError):
                continue
            log.info("pipeline: standby pid %d takes over %s (log %s)", proc.pid, " ".join(argv[:2]), log_path)
            return proc

    def _popen(self, cmd: list[str], log_path: Path, stdin: Any) -> subprocess.Popen:
        from engine.shards import worker_process

        proc = worker_process.spawn(cmd, log_path, stdin=stdin)
        with self._lock:
            self.fleet.procs.append(proc)  # fleet.stop() ends it
        if getattr(self.fleet, "_stopped", False):  # stopped meanwhile: do not leave it behind
            process.kill_tree(proc)
        return proc


def _worker_argv(args: Any) -> list[str] | None:
    """The worker arguments of a `python -m engine.shards.worker ...` command line."""
    if not isinstance(args, (list, tuple)):
        return None
    args = [str(a) for a in args]
    try:
        k = args.index(WORKER_MODULE)
    except ValueError:
        return None
    return args[k + 1:] if k >= 1 and args[k - 1] == "-m" else None


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m engine.pipeline.standby", description=__doc__.split("\n")[0])
    p.add_argument("--parent-pid", type=int, help="exit when this process is gone (pid + creation time)")
    a = p.parse_args(argv)
    from engine.shards import worker

    if a.parent_pid:
        worker.watch_parent(a.parent_pid)
    # Warm up what a worker needs before it can serve: the imports, and the OpenVINO plugin.
    import numpy  # noqa: F401
    import openvino as ov
    import zmq  # noqa: F401

    import engine.shards.export  # noqa: F401

    try:
        ov.Core().get_available_devices()
    except Exception:  # noqa: BLE001 - the worker reports a real problem itself
        pass
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    try:
        args = json.loads(line)
        if not (isinstance(args, list) and all(isinstance(x, str) for x in args)):
            raise ValueError("not a list of strings")
    except ValueError as e:
        print(f"standby: bad worker arguments: {e}", file=sys.stderr)
        return 2
    return worker.main(args)


if __name__ == "__main__":
    sys.exit(main())
