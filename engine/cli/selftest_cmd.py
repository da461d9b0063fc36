"""`flotilla selftest`: does Flotilla work on this PC? The fleet and both local engines, end to end.

    flotilla selftest [--no-mdns] [--keep] [--json FILE] [--timeout S]

The portable smoke test a user, or a hosted Windows/macOS CI runner, runs; `make test` runs the
same command here (tests/engine/cli/test_selftest.py). One line per step, in this order:

    models   the demo models exist (built locally, in seconds, when missing)
    agents   2 `flotilla agent --headless` processes, loopback only, each with its own config
             and data in a temp folder; their stdin is their lifeline (closed when we stop them
             or die), and on Windows they are in our kill-on-close Job object too
    find     both answer on their info port at 127.0.0.1:PORT (what `agent peers --add` does)
    mdns     both are found over mDNS on 127.0.0.1 (--no-mdns leaves this step out)
    pair     pairing as a user does it: this controller asks, each agent's owner accepts the
             code with `flotilla agent pair --accept CODE`, the controller asks again
    status   a CURVE Status request to each agent's control port: both share this PC now
    launch   a 2-stage pipeline of `demo` over them: shards sent, workers started, ring wired
    answer   one answer through the pipeline
    stop     the pipeline unloaded and the agents stopped: none of their processes is left
    moe      one short chat with the MoE engine (demo-moe)
    sparse   one short chat with the sparse engine (demo)
    cleanup  the temp folder removed

The first failed step ends the run: its line says why, and the command exits 1 naming it.
Everything started is stopped by pid (asked, then killed with its children) and the temp folder
removed, on failure and on Ctrl-C too. This process is its own controller with a throw-away key
(FLOTILLA_CONFIG points into the temp folder while it runs): the user's keys, pairings and
settings are never read or written. Demo models and exported shards go to the usual model cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.cli.errors import UserError

AGENTS = 2
STOP_GRACE_S = 10.0  # an agent asked to stop (stdin closed) is killed after this
PROMPT = "Hi"
TOKENS = 8  # per answer: enough to go through every stage a few times
MOE_BUDGET = 2_000_000  # bytes of experts in RAM: smaller than demo-moe's experts, so some are read
SPARSE_BUDGET = 4_000_000  # bytes of neurons in RAM
REPO_ROOT = Path(__file__).resolve().parents[2]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "selftest", help="check this PC end to end: 2 local agents, pairing, a 2-stage pipeline, MoE and sparse",
        description="The fleet and both local engines, end to end, on this PC (loopback only): 2 agents as "
                    "separate processes, found by address and over mDNS, paired with codes, a 2-stage pipeline "
                    "of the demo model answering once, everything stopped; then one short chat each with the "
                    "MoE engine (demo-moe) and the sparse engine. One line per step; exit code 1 names the "
                    "step that failed. Nothing of yours is touched: keys and settings live in a temp folder "
                    "removed at the end.")
    p.add_argument("--no-mdns", action="store_true",
                   help="leave out the mDNS step (networks or firewalls that block multicast on loopback)")
    p.add_argument("--timeout", type=float, default=180.0, metavar="S",
                   help="how long to wait for an agent to come up, a pairing, a status or an answer "
                        "(default 180)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the steps as JSON to FILE")
    p.add_argument("--keep", action="store_true", help="keep the temp folder (agent logs) afterwards")
    p.set_defaults(func=cmd_selftest)


@dataclass
class StepResult:
    name: str  # the step (see the module docstring)
    ok: bool  # passed
    seconds: float  # how long it took
    detail: str  # what it saw, or why it failed


class StepFailed(Exception):
    """A step found something wrong (its message is the one line the user reads)."""


class _Agent:
    """One agent process of the self test, on loopback with its own config folder."""

    def __init__(self, root: Path, index: int) -> None:
        from engine.fleet.policy import SharingPolicy
        from engine.paths import ensure_private_dir

        self.index = index
        self.config = ensure_private_dir(root / f"agent-{index}")
        self.log = root / f"agent-{index}.out"
        # This PC counts as idle, and its own load (us) must not refuse the pipeline.
        SharingPolicy(idle_minutes=0.0, require_ac=False, max_cpu_percent_to_start=100.0).save(self.config)
        self.proc: subprocess.Popen | None = None
        self.node_id = ""
        self.ports: tuple[int, int, int] = (0, 0, 0)  # control, pairing, info

    def env(self, base: dict[str, str]) -> dict[str, str]:
        env = {**base, "FLOTILLA_CONFIG": str(self.config)}
        env.pop("FLOTILLA_DATA", None)  # data (shards, logs) inside its config folder, in the temp folder
        return env

    def start(self, base_env: dict[str, str]) -> None:
        from engine.platform import process

        argv = [sys.executable, "-m", "engine.cli.agent_cmd", "--headless", "-v", "--bind", "127.0.0.1",
                "--port", "0", "--interface", "127.0.0.1", "--idle-source", "none", "--mdns-ttl", "10",
                "--stdin-lifeline", "--announce"]  # --announce: its ports as one AgentUp line, in the log too
        with open(self.log, "ab") as out:
            self.proc = process.spawn(argv, die_with_us=True, stdin=subprocess.PIPE, stdout=out,
                                      stderr=subprocess.STDOUT, env=self.env(base_env), cwd=str(REPO_ROOT))

    def wait_up(self, deadline: float) -> None:
        from engine.protocol.control import AgentUp
        from engine.protocol.errors import ProtocolError

        assert self.proc is not None
        while True:
            for line in self.log.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    up = AgentUp.from_line(line)
                except ProtocolError as e:
                    raise StepFailed(f"agent {self.index} announced itself wrongly: {e}") from None
                if up is not None:
                    self.node_id = up.node_id
                    self.ports = (up.control_port, up.pair_port, up.info_port)
                    return
            if self.proc.poll() is not None:
                raise StepFailed(f"agent {self.index} exited with code {self.proc.returncode}: {self.tail()}")
            if time.monotonic() > deadline:
                raise StepFailed(f"agent {self.index} not up in time: {self.tail()}")
            time.sleep(0.1)

    @property
    def public_key(self) -> str:
        return (self.config / "node_key.public").read_text(encoding="utf-8").strip()

    def tail(self, n: int = 4) -> str:
        try:
            lines = self.log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-n:]) or "(empty log)"


def _close_stdin(proc: subprocess.Popen) -> None:
    try:
        if proc.stdin is not None:
            proc.stdin.close()
    except OSError:
        pass


class _Selftest:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: list[StepResult] = []
        self.root = Path(tempfile.mkdtemp(prefix="flotilla-selftest-"))  # mode 0700, ours
        self.base_env = dict(os.environ)
        self.base_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), self.base_env.get("PYTHONPATH", "")) if p)
        self.agents: list[_Agent] = []
        self.keys: Any = None
        self.peers: list[Any] = []
        self.engine: Any = None
        self.family: list[Any] = []  # ProcessRef of every agent and worker, to check none is left

    # -- the frame ----------------------------------------------------------------
    def step(self, name: str, fn: Callable[[], str]) -> None:
        t0 = time.monotonic()
        try:
            detail, ok = fn(), True
        except StepFailed as e:
            detail, ok = str(e), False
        except Exception as e:  # a step's own error is the step's failure, named, not a traceback
            detail, ok = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}", False
        result = StepResult(name, ok, round(time.monotonic() - t0, 2), detail)
        self.results.append(result)
        print(f"selftest: {'ok  ' if ok else 'FAIL'} {name:<8} {result.seconds:6.1f} s  {detail}", flush=True)
        if not ok:
            raise UserError(f"selftest failed at step {name!r}: {detail}")

    def deadline(self) -> float:
        return time.monotonic() + self.args.timeout

    # -- the steps ----------------------------------------------------------------
    def models(self) -> str:
        from engine.models.demo import ensure_demo

        built = [ensure_demo(m).name for m in ("demo", "demo-moe")]
        return "demo models ready: " + ", ".join(built)

    def start_agents(self) -> str:
        self.agents = [_Agent(self.root, i) for i in range(AGENTS)]
        for a in self.agents:
            a.start(self.base_env)
        end = self.deadline()
        for a in self.agents:
            a.wait_up(end)
        return ", ".join(f"agent {a.index} pid {a.proc.pid} node {a.node_id[:8]} control {a.ports[0]}"
                         for a in self.agents if a.proc is not None)

    def find(self) -> str:
        import zmq.asyncio

        from engine import aio
        from engine.fleet.discovery import Peer, async_dial

        async def run() -> list[Any]:
            ctx = zmq.asyncio.Context()
            try:
                found = []
                for a in self.agents:
                    hit = await async_dial(ctx, a.node_id, ["127.0.0.1"], a.ports[2], timeout_each=5.0)
                    if hit is None:
                        raise StepFailed(f"agent {a.index} does not answer on 127.0.0.1:{a.ports[2]} (info)")
                    host, info = hit
                    found.append(Peer(info, (host,), "manual", time.time(), reached=host))
                return sorted(found, key=lambda p: p.node_id)
            finally:
                ctx.term()

        self.peers = aio.run(run())
        return "both answer on 127.0.0.1: " + ", ".join(f"{p.node_id[:8]} key {p.info.fingerprint}"
                                                        for p in self.peers)

    def mdns(self) -> str:
        from engine import aio
        from engine.fleet.controller_setup import async_discover

        keys = {a.public_key for a in self.agents}
        found = aio.run(async_discover(["127.0.0.1"], keys=keys, timeout=min(self.args.timeout, 30.0)))
        if len(found) < AGENTS:
            raise StepFailed(f"found {len(found)} of {AGENTS} agents over mDNS on 127.0.0.1 within 30 s "
                             "(multicast on loopback blocked? --no-mdns leaves this step out)")
        return f"both announced on 127.0.0.1 ({', '.join(p.endpoint() for p in found)})"

    def pair(self) -> str:
        from engine import aio
        from engine.fleet.client import async_pair
        from engine.fleet.controller_setup import controller_keys
        from engine.transport.security import pairing_code

        self.keys = controller_keys(self.root / "controller")
        codes = []
        for agent, peer in zip(sorted(self.agents, key=lambda a: a.node_id), self.peers):
            endpoint = peer.endpoint(peer.info.pair_port)
            first = aio.run(async_pair(self.keys, endpoint, peer.info.public_key, "flotilla-selftest"))
            expected = pairing_code(peer.info.public_key, self.keys.public)
            if first.state != "pending" or first.code != expected:
                raise StepFailed(f"agent {agent.index} answered {first.state!r} code {first.code} (expected "
                                 f"pending, code {expected})")
            res = subprocess.run([sys.executable, "-m", "engine.cli.agent_cmd", "pair", "--accept", first.code],
                                 env=agent.env(self.base_env), cwd=str(REPO_ROOT), capture_output=True,
                                 text=True, encoding="utf-8", errors="replace", timeout=self.args.timeout)
            if res.returncode != 0:
                raise StepFailed(f"`flotilla agent pair --accept {first.code}` on agent {agent.index} failed: "
                                 f"{res.stderr.strip()[-300:]}")
            second = aio.run(async_pair(self.keys, endpoint, peer.info.public_key, "flotilla-selftest"))
            if second.state != "accepted":
                raise StepFailed(f"agent {agent.index} still says {second.state!r} after the code was accepted")
            codes.append(first.code)
        return f"codes {', '.join(codes)} accepted on the agents; both paired"

    def status(self) -> str:
        from engine import aio
        from engine.fleet.client import AgentClient

        async def one(peer: Any) -> Any:
            async with AgentClient(self.keys, peer.endpoint(), peer.info.public_key, timeout=10.0) as client:
                return await client.status()

        out = []
        for peer in self.peers:
            reply = aio.run(one(peer))
            if not reply.sharing:
                raise StepFailed(f"node {peer.node_id[:8]} does not share: {reply.reason}")
            out.append(f"{peer.node_id[:8]} shares {reply.info.ram_available / 2**30:.1f} GiB")
        return "; ".join(out)

    def launch(self) -> str:
        from engine.fleet.launch import launch_fleet
        from engine.fleet.launch_config import LaunchConfig

        cfg = LaunchConfig(model="demo", stages=AGENTS, max_concurrent=1, controller_host="127.0.0.1")
        self.engine = launch_fleet(self.keys, self.peers, cfg)
        plan = self.engine.fleet.summary()["plan"]
        if len(plan) != AGENTS or len({st["node_id"] for st in plan}) != AGENTS:
            raise StepFailed(f"the plan is not {AGENTS} stages on {AGENTS} agents: {plan}")
        self._remember_family()
        return "; ".join(f"stage {st['stage']} layers {st['layers'][0]}-{st['layers'][1]} on "
                         f"{st['node_id'][:8]} port {st['data_port']}" for st in plan)

    def answer(self) -> str:
        text, final = _chat(self.engine, self.args.timeout)
        return f"{final.usage.completion_tokens} tokens, {final.timings.decode_tok_s:.0f} tok/s: {text!r}"

    def stop(self) -> str:
        """Unload the pipeline, then ask each agent to stop the way the tray does (close its
        stdin). An agent that has not exited by itself within STOP_GRACE_S fails the step (it
        is killed, with its children, so nothing is left either way)."""
        from engine.platform import process

        self._remember_family()
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()
        agents = [a for a in self.agents if a.proc is not None]
        for a in agents:
            _close_stdin(a.proc)
        end = time.monotonic() + STOP_GRACE_S
        killed = []
        for a in agents:
            try:
                a.proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                killed.append(a)
                process.kill_tree(a.proc)
                try:
                    a.proc.wait(process.REAP_S)
                except subprocess.TimeoutExpired:
                    pass
        left = self._wait_family_gone(10.0)
        if killed:
            raise StepFailed(", ".join(f"agent {a.index} (pid {a.proc.pid}) did not exit within "
                                       f"{STOP_GRACE_S:.0f} s of its stdin closing: killed" for a in killed)
                             + f" | {killed[0].tail(2)}")
        if left:
            raise StepFailed("still running after the agents stopped: pids " + ", ".join(str(p) for p in left))
        codes = ", ".join(str(a.proc.returncode) for a in agents)
        return f"{len(self.family)} processes (agents and their workers) gone; agents exited with {codes}"

    def _wait_family_gone(self, timeout: float) -> list[int]:
        """Wait for every remembered process to end; kill and return the pids that did not."""
        from engine.platform import process

        end = time.monotonic() + timeout
        left = [r for r in self.family if r.alive()]
        while left and time.monotonic() < end:
            time.sleep(0.1)
            left = [r for r in left if r.alive()]
        for r in left:
            process.kill_tree(r.pid)
        return [r.pid for r in left]

    def local_chat(self, kind: str, model: str, budget: int) -> str:
        from engine.local.factory import EngineOptions, open_engine

        engine = open_engine(model, kind=kind, options=EngineOptions(cache_budget_bytes=budget))
        try:
            text, final = _chat(engine, self.args.timeout)
        finally:
            engine.close()
        return (f"{model}: {final.usage.completion_tokens} tokens, {final.timings.decode_tok_s:.0f} tok/s "
                f"({budget / 1e6:.0f} MB cache): {text!r}")

    def cleanup(self) -> str:
        if self.args.keep:
            return f"kept {self.root}"
        _remove(self.root)
        if self.root.exists():
            raise StepFailed(f"could not remove {self.root}")
        return f"removed {self.root}"

    # -- bookkeeping --------------------------------------------------------------
    def _remember_family(self) -> None:
        """The agents and everything they started (shard workers), by pid + creation time."""
        import psutil

        from engine.platform.process import ProcessRef

        known = {(r.pid, r.created) for r in self.family}
        for a in self.agents:
            if a.proc is None or a.proc.poll() is not None:
                continue
            try:
                pids = [a.proc.pid] + [c.pid for c in psutil.Process(a.proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for pid in pids:
                ref = ProcessRef.of(pid)
                if ref is not None and (ref.pid, ref.created) not in known:
                    self.family.append(ref)
                    known.add((ref.pid, ref.created))

    def teardown(self) -> None:
        """Whatever a failed or interrupted run left: stopped by pid, the temp folder removed."""
        from engine.platform import process

        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:
                pass
            self.engine = None
        self._remember_family()
        procs = [a.proc for a in self.agents if a.proc is not None and a.proc.poll() is None]
        if procs:
            process.stop_all(procs, STOP_GRACE_S, ask={p: (lambda p=p: _close_stdin(p)) for p in procs})
        for ref in self.family:
            if ref.alive():
                process.kill_tree(ref.pid)
        if not self.args.keep:
            _remove(self.root)


def _chat(engine: Any, timeout: float) -> tuple[str, Any]:
    """One short greedy answer; (its text, the final event). StepFailed when it did not end well."""
    import uuid

    from engine.protocol.messages import ChatMessage, GenerateRequest, SamplingParams

    req = GenerateRequest(uuid.uuid4().hex, messages=(ChatMessage("user", PROMPT),),
                          sampling=SamplingParams(max_tokens=TOKENS, temperature=0.0))
    pieces, final = [], None
    for ev in engine.stream(engine.submit(req), timeout=timeout):
        pieces.append(ev.text or "")
        if ev.final:
            final = ev
    if final is None or final.finish_reason == "error":
        raise StepFailed(f"no answer: {getattr(final, 'error', None) or 'the stream ended without a final event'}")
    if not final.usage or final.usage.completion_tokens < 1:
        raise StepFailed(f"an empty answer ({final.finish_reason})")
    return "".join(pieces)[:40], final


def _remove(root: Path) -> None:
    """rmtree, retried briefly: on Windows a just-exited process's files can stay locked a moment."""
    for _ in range(20):
        shutil.rmtree(root, ignore_errors=True)
        if not root.exists():
            return
        time.sleep(0.25)


def cmd_selftest(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise UserError("--timeout must be positive")
    # SIGTERM (and SIGHUP) become SystemExit, so the teardown below runs (Ctrl-C: KeyboardInterrupt).
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            try:
                signal.signal(sig, lambda *_: sys.exit(143))
            except (ValueError, OSError):  # not the main thread (called from a test harness)
                pass
    t0 = time.monotonic()
    run = _Selftest(args)
    saved = {k: os.environ.get(k) for k in ("FLOTILLA_CONFIG", "FLOTILLA_DATA")}
    os.environ["FLOTILLA_CONFIG"] = str(run.root / "controller")  # this run's own controller identity
    os.environ.pop("FLOTILLA_DATA", None)
    try:
        run.step("models", run.models)
        run.step("agents", run.start_agents)
        run.step("find", run.find)
        if not args.no_mdns:
            run.step("mdns", run.mdns)
        run.step("pair", run.pair)
        run.step("status", run.status)
        run.step("launch", run.launch)
        run.step("answer", run.answer)
        run.step("stop", run.stop)
        run.step("moe", lambda: run.local_chat("moe", "demo-moe", MOE_BUDGET))
        run.step("sparse", lambda: run.local_chat("sparse", "demo", SPARSE_BUDGET))
        run.step("cleanup", run.cleanup)
        print(f"selftest: all {len(run.results)} steps ok in {time.monotonic() - t0:.1f} s", flush=True)
        return 0
    finally:
        run.teardown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"ok": bool(run.results) and all(r.ok for r in run.results),
                                             "steps": [asdict(r) for r in run.results]}, indent=2) + "\n",
                                 encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    from engine.cli.main import _run_guarded

    parser = argparse.ArgumentParser(prog="flotilla")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["selftest", *(sys.argv[1:] if argv is None else argv)])
    return _run_guarded(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
