"""`flotilla serve`: the OpenAI-compatible HTTP API on one model."""

from __future__ import annotations

import argparse
import os
import sys

from engine.cli.chat_cmd import add_engine_arguments, open_engine_from_args
from engine.cli.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this PC only; 0.0.0.0 exposes it to the LAN, and "
                        "any address but loopback requires an API key: see --api-key, --no-auth)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=os.environ.get("FLOTILLA_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: $FLOTILLA_API_KEY; else none on loopback, "
                        "and beyond loopback the key kept in the keys folder, generated on first use)")
    p.add_argument("--no-auth", action="store_true",
                   help="serve beyond loopback with no API key (anyone who reaches the address can use it)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.platform.memory import settle_heap
    from engine.serve.api import create_app, run_server

    if not 0 <= args.port < 65536:
        raise UserError(f"--port must be 0..65535 (0 picks a free port), got {args.port}")
    from engine.serve.auth import decide

    access = decide(args.host, args.port, args.api_key, args.no_auth)  # before the model loads: a key
    engine = open_engine_from_args(args)  # problem shows at once
    try:
        settle_heap()  # no full collection of the loaded libraries mid-answer
        app = create_app(engine, api_key=access.api_key)
        if access.notice:
            print(access.notice, file=sys.stderr)
        print(f"serving {engine.info.model_id} at http://{args.host}:{args.port}/v1 "
              f"(OpenAPI spec at /openapi.json)", file=sys.stderr, flush=True)
        run_server(app, host=args.host, port=args.port)
    finally:
        engine.close()
    return 0
