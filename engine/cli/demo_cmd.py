"""`flotilla demo --headless`: the whole fleet on one PC, start to finish.

    flotilla demo --headless [-p PROMPT] [--max-tokens N] [--stages N|auto] [--json FILE]

1. starts 2 agents in the background (separate processes, each with its own
   private config dir under a fresh temp folder, bound to 127.0.0.1, mDNS on
   127.0.0.1 only: nothing leaves this PC);
2. discovers them over mDNS on loopback;
3. pairs with them: the codes are shown as in a real pairing, and the agents
   accept this demo's own key without a human because they run in demo mode
   (engine/fleet/demo_mode.py says why that is not a hole);
4. plans `demo` over them, sends each agent its shard (hashed, resumable),
   starts the shard workers (CURVE on every control and data socket) and
   wires a pipeline;
5. streams one answer, prints a summary (peers, plan, tok/s);
6. stops everything (workers, agents, temp folder) and exits 0; also on
   Ctrl-C or failure, with no process left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine.cli.errors import UserError
from engine.platform import process

AGENTS = 2
STOP_GRACE_S = 8.0  # an agent asked to stop -> killed
DEFAULT_PROMPT = "Write a poem about the wind."  # the random-weight demo model answers it at length
REPO_ROOT = Path(__file__).resolve().parents[2]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="see the whole fleet on this PC: 2 agents, discovery, pairing, a 2-stage pipeline",
                       description="Start 2 agents on this PC (loopback only), find them over mDNS, pair, run "
                                   "a 2-stage pipeline of the demo model, answer one prompt, stop everything.")
    p.add_argument("--headless", action="store_true", help="terminal only (the desktop app has its own demo)")
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="what to ask")
    p.add_argument("--model", "-m", default="demo", help="model (default: demo)")
    p.add_argument("--max-tokens", type=int, default=48, help="answer length (default 48)")
    p.add_argument("--stages", default="2", help="stages: a number (default 2) or 'auto' (the planner decides)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the summary as JSON to FILE")
    p.add_argument("--keep", action="store_true", help="keep the demo's temp folder (logs) afterwards")
    p.set_defaults(func=cmd_demo)


def _say(text: str) -> None:
    print(f"demo: {text}", file=sys.stderr, flush=True)


class _Agents:
    """The demo's agent processes; stop() leaves none behind (idempotent)."""

    def __init__(self, root: Path, controller_key: str) -> None:
        from engine.fleet.demo_mode import make_agent_dir
        from engine.fleet.policy import SharingPolicy

        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.configs: list[Path] = []
        for i in range(AGENTS):
            config = make_agent_dir(root, f"agent-{i}", controller_key)
            # The demo PC is "idle" by construction; its own CPU load must not refuse the demo.
            SharingPolicy(idle_minutes=0.0, require_ac=False, max_cpu_percent_to_start=100.0).save(config)
            self.configs.append(config)

    def start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        for i, config in enumerate(self.configs):
            env_i = {**env, "FLOTILLA_CONFIG": str(config)}
            env_i.pop("FLOTILLA_DATA", None)  # data (shards, logs) inside the demo folder too
            argv = [sys.executable, "-m", "engine.cli.agent_cmd", "--headless", "--bind", "127.0.0.1",
                    "--port", "0", "--interface", "127.0.0.1", "--idle-source", "none", "--mdns-ttl", "10",
                    "--demo-auto-pair", "--stdin-lifeline"]
            with open(self.root / f"agent-{i}.out", "ab") as out:
                # Own process group: a Ctrl-C in the terminal reaches only us; we stop them in order.
                # stdin is their lifeline: stop() closes it (and so does our death).
                self.procs.append(process.spawn(argv, stdin=subprocess.PIPE, stdout=out, stderr=out,
                                                env=env_i, cwd=str(REPO_ROOT)))

    def public_keys(self, timeout: float = 30.0) -> list[str]:
        """Each agent's public key, once it has made its identity."""
        end = time.monotonic() + timeout
        keys: list[str] = []
        for i, config in enumerate(self.configs):
            path = config / "node_key.public"
            while not path.exists():
                if self.procs[i].poll() is not None:
                    raise UserError(f"demo agent {i} exited at once: {_tail(self.root / f'agent-{i}.out')}")
                if time.monotonic() > end:
                    raise UserError(f"demo agent {i} did not start within {timeout:.0f} s")
                time.sleep(0.05)
            keys.append(path.read_text().strip())
        return keys

    def stop(self) -> None:
        """Ask every agent to stop (close its stdin: it stops its workers, says goodbye on
        mDNS, exits); kill what is still running after STOP_GRACE_S, workers included."""
        process.stop_all(self.procs, STOP_GRACE_S, ask={p: (lambda p=p: _close(p.stdin)) for p in self.procs})
        self.procs = []


def _close(pipe) -> None:
    try:
        if pipe is not None:
            pipe.close()
    except OSError:
        pass


def _tail(path: Path, n: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])
    except OSError:
        return ""


def cmd_demo(args: argparse.Namespace) -> int:
    if not args.headless:
        raise UserError("the windowed demo comes with the desktop app; run `flotilla demo --headless` here")
    if args.stages != "auto" and not (args.stages.isdigit() and 1 <= int(args.stages) <= AGENTS):
        raise UserError(f"--stages must be 1..{AGENTS} or auto")
    if args.max_tokens < 1:
        raise UserError("--max-tokens must be at least 1")
    from engine.fleet.demo_mode import make_demo_root

    # SIGTERM/SIGHUP become SystemExit so the finally below stops everything (Ctrl-C is KeyboardInterrupt).
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    root = make_demo_root()
    agents = None
    engine = None
    try:
        from engine.fleet.controller_setup import controller_keys

        keys = controller_keys(root / "controller")
        agents = _Agents(root, keys.public)
        agents.start()
        _say(f"started {AGENTS} agents (pids {', '.join(str(p.pid) for p in agents.procs)}), "
             f"config and logs in {root}")
        summary = _run(args, keys, agents, t0)
        engine = summary.pop("_engine")
        engine.close()
        engine = None
        agents.stop()
        summary["stopped_s"] = round(time.monotonic() - t0, 2)
        _print_summary(summary)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(summary, indent=2) + "\n")
        return 0
    finally:
        if engine is not None:
            try:
                engine.close()
            except Exception:
                pass
        if agents is not None:
            agents.stop()
        if args.keep:
            _say(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _run(args: argparse.Namespace, keys, agents: _Agents, t0: float) -> dict:
    from engine import aio
    from engine.cli.progress import TerminalProgress
    from engine.fleet.controller_setup import async_discover, async_pair_all
    from engine.fleet.launch import launch_fleet
    from engine.fleet.launch_config import LaunchConfig
    from engine.protocol.messages import ChatMessage, GenerateRequest, SamplingParams

    agent_keys = agents.public_keys()
    _say("looking for them over mDNS on 127.0.0.1 ...")
    peers = aio.run(async_discover(["127.0.0.1"], keys=set(agent_keys), timeout=30.0))
    t_found = time.monotonic() - t0
    if len(peers) < AGENTS:
        raise UserError(f"found {len(peers)} of {AGENTS} demo agents over mDNS on 127.0.0.1 within 30 s "
                        f"(logs in {agents.root})")
    for p in peers:
        _say(f"found {p.info.hostname} node {p.node_id[:8]} at {p.endpoint()} key {p.info.fingerprint}")

    def code(peer, c: str) -> None:
        _say(f"pairing with node {peer.node_id[:8]}: code {c} (a real agent's owner types it; "
             "demo agents accept this demo's key by themselves)")

    states = aio.run(async_pair_all(keys, peers, "flotilla-demo", wait=10.0, on_code=code))
    if any(s != "accepted" for s in states.values()):
        raise UserError(f"pairing did not complete: {states}")
    _say("paired with both agents")
    stages = None if args.stages == "auto" else int(args.stages)
    cfg = LaunchConfig(model=args.model, stages=stages, max_concurrent=2, controller_host="127.0.0.1")
    progress = TerminalProgress()
    events: list[str] = []
    try:
        engine = launch_fleet(keys, peers, cfg, progress, on_event=lambda ev: events.append(ev.message))
    finally:
        progress.close()
    session = engine.fleet
    for st in session.summary()["plan"]:
        _say(f"stage {st['stage']}: layers {st['layers'][0]}-{st['layers'][1]} on {st['peer']} "
             f"node {st['node_id'][:8]} ({st['device']}), data port {st['data_port']}")
    print(f"\n> {args.prompt}\n", flush=True)
    req = GenerateRequest("demo-1", messages=(ChatMessage("user", args.prompt),),
                          sampling=SamplingParams(max_tokens=args.max_tokens))
    final = None
    for ev in engine.stream(engine.submit(req), timeout=120):
        if ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        if ev.final:
            final = ev
    print("\n", flush=True)
    if final is None or final.finish_reason == "error":
        raise UserError(f"the pipeline failed: {getattr(final, 'error', 'no answer')}")
    s = session.summary()
    s.update({
        "model": engine.info.model_id, "stages": len(engine.stages), "prompt": args.prompt,
        "tokens": final.usage.completion_tokens, "finish_reason": final.finish_reason,
        "decode_tok_s": round(final.timings.decode_tok_s, 1), "ttft_s": round(final.timings.ttft_s, 3),
        "found_s": round(t_found, 2), "answered_s": round(time.monotonic() - t0, 2),
        "curve": "every control and data socket (CurveZMQ, keys checked by ZAP)",
        "events": events, "root": str(agents.root), "_engine": engine,
    })
    return s


def _print_summary(s: dict) -> None:
    print("== flotilla demo summary ==")
    print(f"peers: {len(s['peers'])}")
    for p in s["peers"]:
        print(f"  {p['host']} node {p['node_id'][:8]} at {p['address']} key {p['fingerprint']}")
    print(f"plan: {s['stages']} stages of {s['model']}")
    for st in s["plan"]:
        sent = f"sent {st['sent_bytes'] / 1e6:.1f} MB" if st["sent_bytes"] else "already cached"
        print(f"  stage {st['stage']}: layers {st['layers'][0]}-{st['layers'][1]} on node {st['node_id'][:8]} "
              f"({st['device']}), shard {st['shard_sha256'][:12]} {sent}")
    print(f"answer: {s['tokens']} tokens, {s['decode_tok_s']} tok/s, first token {s['ttft_s'] * 1000:.0f} ms "
          f"({s['finish_reason']})")
    print(f"security: CURVE on {s['curve']}")
    t = s["timings_s"]
    print(f"time: found agents {s['found_s']} s, launch {t.get('launch_s')} s "
          f"(transfer {t.get('transfer_s')} s, load {t.get('load_s')} s), answered at {s['answered_s']} s, "
          f"all stopped at {s['stopped_s']} s")
    if s["events"]:
        print("events: " + "; ".join(s["events"]))
    print("demo: ok", flush=True)


def main(argv: list[str] | None = None) -> int:
    from engine.cli.main import _run_guarded

    parser = argparse.ArgumentParser(prog="flotilla")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo", *(sys.argv[1:] if argv is None else argv)])
    return _run_guarded(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
