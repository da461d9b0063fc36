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
                   help="address to bind (default 127.0.0.1: this PC only; 0.0.0.0 exposes it to the LAN)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=os.environ.get("FLOTILLA_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: $FLOTILLA_API_KEY, else no key)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.serve.api import create_app, run_server

    if not 0 <= args.port < 65536:
        raise UserError(f"--port must be 0..65535 (0 picks a free port), got {args.port}")
    engine = open_engine_from_args(args)
    try:
        app = create_app(engine, api_key=args.api_key)
        print(f"serving {engine.info.model_id} at http://{args.host}:{args.port}/v1 "
              f"(OpenAPI spec at /openapi.json)", file=sys.stderr)
        run_server(app, host=args.host, port=args.port)
    finally:
        engine.close()
    return 0
