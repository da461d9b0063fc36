"""`flotilla agent`: lend this PC to the fleet while its owner is away.

  flotilla agent [--headless] [--port N] [--interface IF] ...   run the agent
  flotilla agent pair --accept CODE | --list | --revoke WHO       pairing, on the agent
  flotilla agent policy [--idle-minutes N] [--max-ram-gb X] ...   show/edit the sharing policy
  flotilla agent peers [--add HOST[:PORT]] [--remove ...] [--watch S]   find agents

`python -m engine.cli.agent_cmd ...` works too (the same as `flotilla agent ...`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

from engine.cli.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="lend this PC to the fleet while it is idle (paired controllers only)",
                       description="Run the fleet agent, or manage its pairing, policy and peers.")
    p.add_argument("--headless", action="store_true",
                   help="no tray icon even when a display exists (servers, CI, ssh sessions)")
    p.add_argument("--port", type=int, default=None,
                   help="control port (default 47600); pairing uses PORT+1 and info PORT+2; "
                        "0 = any free ports (then only mDNS can find them)")
    p.add_argument("--bind", default="*", help="address the agent's sockets bind (default: all)")
    p.add_argument("--interface", action="append", default=[], metavar="IF",
                   help="announce over mDNS on this interface name or IPv4 address only "
                        "(repeatable; default: all interfaces)")
    p.add_argument("--no-mdns", action="store_true",
                   help="do not announce; controllers must add this PC by host:port")
    p.add_argument("--mdns-ttl", type=int, default=None, metavar="S",
                   help="TTL of the mDNS records; a crashed agent vanishes after about this (default 60)")
    p.add_argument("--worker-cmd", default=None, metavar="CMD",
                   help="shard worker command template; placeholders {python} {shard} {sha256} "
                        "{device} {port} {bind} {cache} {parent} {curve} {exact} (default: the pipeline worker)")
    p.add_argument("--idle-source", default="auto", metavar="SRC",
                   help="auto (the desktop session), none (no local user: always idle), "
                        "or file:PATH (PATH holds the unix time of the last input)")
    p.add_argument("-v", "--verbose", action="store_true", help="log more, also to stderr")
    # `flotilla demo` only: pair the demo's own controller without a code. Refused unless the
    # config dir is one `flotilla demo` made (engine/fleet/demo_mode.py says why that is safe).
    p.add_argument("--demo-auto-pair", action="store_true", help=argparse.SUPPRESS)
    # Started by the tray or `flotilla demo` with stdin a pipe: stop cleanly when it ends (they close
    # it to stop us, and it also ends when they die). The same on every OS (engine/fleet/agent_process.py).
    p.add_argument("--stdin-lifeline", action="store_true", help=argparse.SUPPRESS)
    # Started by the app's tray: once serving, write one AgentUp JSON line (its ports) on stdout, and
    # point fd 1 at stderr for everything else, so no library's print can be taken for it.
    p.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_agent)
    asub = p.add_subparsers(dest="agent_command", metavar="SUBCOMMAND")

    pp = asub.add_parser("pair", help="accept, list or revoke paired controllers (on the agent PC)")
    g = pp.add_mutually_exclusive_group(required=True)
    g.add_argument("--accept", metavar="CODE",
                   help="accept the pending controller showing this 6-digit code on its screen")
    g.add_argument("--list", action="store_true", help="paired controllers and pending requests")
    g.add_argument("--revoke", metavar="WHO", help="forget a controller: its name, key or fingerprint")
    pp.set_defaults(func=cmd_pair)

    po = asub.add_parser("policy", help="show or change when this PC may be used")
    po.add_argument("--enable", dest="enabled", action="store_true", default=None)
    po.add_argument("--disable", dest="enabled", action="store_false")
    po.add_argument("--idle-minutes", type=float, help="share only after this long without input")
    po.add_argument("--require-ac", dest="require_ac", action="store_true", default=None,
                    help="never share on battery")
    po.add_argument("--allow-battery", dest="require_ac", action="store_false")
    po.add_argument("--max-ram-gb", type=float, help="RAM all shards together may use")
    po.add_argument("--devices", help="comma-separated device families to share, e.g. CPU,GPU")
    po.set_defaults(func=cmd_policy)

    pe = asub.add_parser("peers", help="list agents on the LAN (mDNS and manual peers)")
    pe.add_argument("--add", metavar="HOST[:PORT]", help="remember an agent that mDNS cannot see")
    pe.add_argument("--remove", metavar="HOST[:PORT]", help="forget a manual peer")
    pe.add_argument("--watch", type=float, default=3.0, metavar="S", help="listen this long (default 3)")
    pe.add_argument("--interface", dest="peer_interface", action="append", default=[], metavar="IF")
    pe.set_defaults(func=cmd_peers)


def _announce_stream() -> Any:
    """A private copy of stdout for the AgentUp line; fd 1 itself then goes to stderr."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    return out


def cmd_agent(args: argparse.Namespace) -> int:
    from engine.fleet.agent_config import AgentConfig
    from engine.fleet.agent_process import run_agent, setup_logging
    from engine.fleet.discovery import DEFAULT_BASE_PORT
    from engine.fleet.idle import idle_source_from_spec
    from engine.fleet.mdns import DEFAULT_TTL_S, resolve_interfaces

    port = DEFAULT_BASE_PORT if args.port is None else args.port
    if not 0 <= port <= 65533:
        raise UserError(f"--port must be 0..65533, got {port}")
    try:
        idle = idle_source_from_spec(args.idle_source)
        resolve_interfaces(args.interface or None)
    except ValueError as e:
        raise UserError(str(e)) from None
    cfg = AgentConfig(bind=args.bind, port=port, mdns=not args.no_mdns,
                      interfaces=args.interface or None, idle=idle,
                      mdns_ttl=args.mdns_ttl or DEFAULT_TTL_S, demo_auto_pair=args.demo_auto_pair,
                      stdin_lifeline=args.stdin_lifeline)
    if args.demo_auto_pair:
        from engine.fleet.demo_mode import check_demo_dir

        try:
            check_demo_dir(cfg.config, cfg.bind)
        except ValueError as e:
            raise UserError(str(e)) from None
    if args.worker_cmd:
        cfg.worker_command = shlex.split(args.worker_cmd)
    if not args.headless and _has_display():
        tray = _tray_entry()
        if tray is not None:  # the desktop app's tray starts `flotilla agent --headless` itself
            return int(tray(_agent_argv(args)) or 0)
        print("flotilla agent: no tray icon (the desktop app is not installed); running headless",
              file=sys.stderr)
    if args.announce:
        cfg.announce = _announce_stream()
    log_path = setup_logging(cfg.data, args.verbose)
    print(f"flotilla agent: config {cfg.config}, log {log_path}", file=sys.stderr, flush=True)
    try:
        return run_agent(cfg)
    except OSError as e:  # e.g. the port is taken
        raise UserError(f"cannot start the agent: {e}") from None


def _has_display() -> bool:
    if sys.platform in ("win32", "darwin"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _tray_entry():
    """The tray UI's run(argv), registered by the app as a `flotilla.tray` entry
    point (engine never imports app); None when the app is not installed."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="flotilla.tray"):
        try:
            return ep.load()
        except Exception as e:  # a broken GUI install must not stop the agent
            print(f"flotilla agent: the tray does not load ({e}); running headless", file=sys.stderr)
    return None


def _agent_argv(args: argparse.Namespace) -> list[str]:
    """These agent options as a command line, for the tray to start the agent with."""
    argv = ["--bind", args.bind, "--idle-source", args.idle_source]
    if args.port is not None:
        argv += ["--port", str(args.port)]
    for i in args.interface:
        argv += ["--interface", i]
    if args.no_mdns:
        argv.append("--no-mdns")
    if args.mdns_ttl:
        argv += ["--mdns-ttl", str(args.mdns_ttl)]
    if args.worker_cmd:
        argv += ["--worker-cmd", args.worker_cmd]
    return argv


def cmd_pair(args: argparse.Namespace) -> int:
    from engine.fleet.paths import config_dir
    from engine.transport.security import PairingBook, fingerprint

    book = PairingBook(config_dir())
    if args.accept:
        code = args.accept.strip().replace(" ", "").replace("-", "")
        if not (len(code) == 6 and code.isdigit()):
            raise UserError("a pairing code is 6 digits")
        try:
            name = book.accept(code)
        except LookupError as e:
            raise UserError(str(e)) from None
        print(f"paired with {name}; it can use this PC from now on (within the sharing policy)")
    elif args.list:
        for key, e in book.allowed.entries().items():
            print(f"paired   {fingerprint(key)}  {e.get('name', '')}")
        for key, e in book.pending().items():
            print(f"pending  {fingerprint(key)}  {e.get('name', '')}  code {e.get('code')}")
    else:
        gone = book.allowed.revoke(args.revoke)
        if not gone:
            raise UserError(f"no paired controller matches {args.revoke!r}")
        print("revoked: " + ", ".join(gone))
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from engine.fleet.paths import config_dir
    from engine.fleet.policy import SharingPolicy

    cfg = config_dir()
    policy = SharingPolicy.load(cfg)
    changes = {k: v for k, v in (("enabled", args.enabled), ("idle_minutes", args.idle_minutes),
                                 ("require_ac", args.require_ac), ("max_ram_gb", args.max_ram_gb))
               if v is not None}
    if args.devices:
        changes["devices"] = tuple(d.strip() for d in args.devices.split(",") if d.strip())
    if changes:
        try:
            policy = dataclasses.replace(policy, **changes)
        except ValueError as e:
            raise UserError(str(e)) from None
        policy.save(cfg)
    print(json.dumps(dataclasses.asdict(policy), indent=2))
    return 0


def cmd_peers(args: argparse.Namespace) -> int:
    import asyncio

    from engine import aio
    from engine.fleet.discovery import Combined, ManualPeers
    from engine.fleet.mdns import MdnsDiscovery, peer_json
    from engine.fleet.paths import config_dir

    manual = ManualPeers(config_dir(), interval=1.0)
    try:
        if args.add:
            manual.add(args.add)
            print(f"added {args.add}")
        if args.remove:
            manual.remove(args.remove)
            print(f"removed {args.remove}")
    except ValueError as e:
        raise UserError(str(e)) from None

    async def watch() -> None:
        disc = Combined(MdnsDiscovery(args.peer_interface or None), manual)
        await disc.async_start()
        await asyncio.sleep(args.watch)
        await disc.async_close()
        for peer in disc.peers().values():
            print(peer_json("peer", peer))

    aio.run(watch())
    return 0


def main(argv: list[str] | None = None) -> int:
    from engine.cli.main import _run_guarded

    parser = argparse.ArgumentParser(prog="flotilla")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["agent", *(sys.argv[1:] if argv is None else argv)])
    return _run_guarded(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
